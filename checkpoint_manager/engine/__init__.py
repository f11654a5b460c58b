"""Engines: how one rank's share of the training state becomes files in a pending checkpoint directory, and back."""
