"""The training state: gathered from live objects for a save, checked and applied in place on a load."""
