"""The profiler trace: its model (model.py), loading (load.py: streaming decode in decode.py, in
worker processes in parallel.py; steps in steps.py), interval algebra (intervals.py) and the
queries rules share (queries.py)."""
