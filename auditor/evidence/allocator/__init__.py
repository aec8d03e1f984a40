"""A simulator of PyTorch's CUDA caching allocator, driven by a snapshot's recorded requests.

config: settings (PYTORCH_CUDA_ALLOC_CONF, a snapshot's allocator_settings) and size rounding;
simulator: the allocator's decisions; replay: a snapshot's requests through it, from the state at
the trace's first entry; analysis: the replay against the recording, what-ifs, churn;
records: the typed results (findings.json's `allocator` section).
"""
