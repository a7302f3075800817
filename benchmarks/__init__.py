"""nblaunch's benchmarks: ``python -m benchmarks`` (see benchmarks/run.py and benchmarks/README.md)."""
