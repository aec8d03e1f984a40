"""auditor: a PyTorch training-performance auditor.

The pipeline is the architecture: capture -> evidence -> rules -> reports. Layers import downward
only: evidence imports none of the others; capture and rules import evidence and the top-level
findings, fixes and config modules; reports import evidence, findings, fixes and the rule registry
(for the rules' docs).
"""
__version__ = "0.1.0"

# Set by `audit run` (auditor.capture.steps) while it audits a whole program; None otherwise.
_step_hook = None


def step() -> None:
    """Mark the end of one iteration of your training loop, for `audit run file.py` to count steps
    by where neither an optimizer step nor a DataLoader iteration marks them. A no-op (one global
    read) when the program is not being audited."""
    hook = _step_hook
    if hook is not None:
        hook()
