"""Helpers several rules share: places (tallies by source line, costs), trends (robust statistics),
text (how messages write numbers and lines), hooks (piling hook registrations), scans (graph scans), confidence (how sure a
timing verdict is, in one vocabulary), alloc_conf (PYTORCH_CUDA_ALLOC_CONF), numerics_evidence (the
numerics collector's evidence read), short_kernels (kernels shorter than their launch)."""
