"""The library version, in one place (recorded in every checkpoint.json)."""

__version__ = "0.1.0"
