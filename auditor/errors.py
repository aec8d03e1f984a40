"""The exit codes of `audit` and `auditor.AuditError`, the one exception the Python API raises:
the pipelines' usage errors are UsageFailure, one of them, into which the commands turn the input's,
the target's, the config's and the options' own errors (InputError, TargetError, ConfigError,
OptionError).

Exit codes (a contract, documented in the README):
  0  audit done, no finding at or above --fail-on (or --fail-on not given)
  1  a finding at or above --fail-on
  2  usage error: bad TARGET, missing file, no such callable, bad option or input file; or an
     output that could not be written (a full disk: named on the terminal)
  3  the target failed: its step or setup raised, was interrupted, ran out of memory or crashed
  4  internal error of the auditor itself (one line; AUDIT_DEBUG=1 shows the traceback)
"""
from __future__ import annotations

EXIT_OK, EXIT_FAIL_ON, EXIT_USAGE, EXIT_TARGET_FAILED, EXIT_INTERNAL = 0, 1, 2, 3, 4


class AuditError(Exception):
    """An audit that could not be made: `message` is the line `audit` prints after "audit: error: ",
    `exit_code` the status it exits with."""

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if exit_code is not None:
            self.exit_code = exit_code


class UsageFailure(AuditError):
    """A usage error (auditor.cli prints it as one line and exits 2)."""

    exit_code = EXIT_USAGE
