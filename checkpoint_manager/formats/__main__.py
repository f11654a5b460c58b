"""``python -m checkpoint_manager.formats``: the commands are ``ckpt``'s; this only says which one to run."""

import sys

print("use ckpt: ckpt export CKPT --to hf --out DIR | convert | pack | unpack | list BUNDLE (see ckpt --help)", file=sys.stderr)
sys.exit(2)
