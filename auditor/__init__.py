"""auditor: a PyTorch training-performance auditor.

The pipeline is the architecture: capture -> evidence -> rules -> reports. Layers import downward
only: evidence imports none of the others; capture and rules import evidence and the top-level
findings, fixes and config modules; reports import evidence, findings, fixes and the rule registry
(for the rules' docs).
"""
from auditor.step_marker import step

__version__ = "0.1.0"
__all__ = ["step", "__version__"]
