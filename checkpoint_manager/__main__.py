"""``python -m checkpoint_manager``: the ``ckpt`` command line (see :mod:`checkpoint_manager.cli`)."""

import sys

from checkpoint_manager.cli import main

sys.exit(main())
