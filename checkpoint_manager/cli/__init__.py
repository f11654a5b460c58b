"""The ``ckpt`` command line: list, inspect, verify, diff, export and prune checkpoints from a shell.

Installed as the ``ckpt`` console script and runnable as ``python -m checkpoint_manager``. Every
command is a thin layer over the library's own functions, so the shell and Python agree.
"""

from checkpoint_manager.cli.app import main

__all__ = ["main"]
