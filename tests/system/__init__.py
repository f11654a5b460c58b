"""Whole jobs: crashes and kills, injected faults, soak, several processes, S3, docs, install, benchmarks."""
