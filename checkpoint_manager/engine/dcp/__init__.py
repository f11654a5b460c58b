"""The default engine: torch.distributed.checkpoint files, written and read at the disk's speed."""
