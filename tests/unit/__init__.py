"""Tests of one layer each: a directory per package of ``checkpoint_manager``, its top-level modules here."""
