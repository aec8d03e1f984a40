"""auditor: a PyTorch training-performance auditor.

The pipeline is the architecture: capture -> evidence -> rules -> reports. Each subpackage depends
only on the ones before it.
"""
__version__ = "0.1.0"
