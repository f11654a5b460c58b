"""Benchmarks for checkpoint-manager: each measurement runs in its own process (see run.py)."""
