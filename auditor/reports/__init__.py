"""Reporters: one small class per output format, all rendering the same evidence and findings."""
from auditor.reports.outputs import all_reporters, write_reports

__all__ = ["all_reporters", "write_reports"]
