"""``python -m checkpoint_manager.formats``: see :mod:`checkpoint_manager.formats.cli`."""

import sys

from checkpoint_manager.formats.cli import main

sys.exit(main())
