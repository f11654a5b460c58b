"""Low-level pieces every layer uses: checksums, safe file reads, lossless JSON, process groups, the checkpoint record."""
