"""``ckpt cache list`` and ``ckpt cache clear``: the bundles unpacked for loading, and their removal.

Loading a bundle unpacks it once into a per-user cache (see ``docs/formats.md``); these show what
it holds and free the space, all of it or one bundle's.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from checkpoint_manager.cli.output import Output, human_bytes

__all__ = ["add_parser"]

EPILOG = """\
examples:
  ckpt cache list                     unpacked bundles, least recently used first
  ckpt cache clear                    remove them all
  ckpt cache clear model.tar          remove only this bundle's copy
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "cache",
        parents=[common],
        help="list or clear the cache of unpacked bundles",
        description="Bundles are unpacked once, into a cache private to this user "
        "($CHECKPOINT_MANAGER_CACHE/bundles, else the temp directory), bounded by "
        "$CHECKPOINT_MANAGER_BUNDLE_CACHE_MAX. List what it holds, or clear it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", parents=[common], help="the unpacked bundles, their size and last use")
    listing.set_defaults(run=run_list)
    clear = actions.add_parser("clear", parents=[common], help="remove unpacked bundles (all, or one bundle's)")
    clear.add_argument("bundle", nargs="?", metavar="BUNDLE", help="only the copy of this bundle file")
    clear.set_defaults(run=run_clear)


def _doc(entry: Any) -> dict[str, Any]:
    return {
        "bundle": entry.bundle,
        "path": str(entry.path),
        "bytes": entry.bytes,
        "last_used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.last_used)),
        "current": entry.current,
    }


def run_list(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.formats.bundle import cache_limit, default_cache_dir, list_bundle_cache

    entries = list_bundle_cache()
    doc: dict[str, Any] = {
        "cache": str(default_cache_dir()),
        "limit_bytes": cache_limit(),
        "bytes": sum(e.bytes for e in entries),
        "entries": [_doc(e) for e in entries],
    }
    if out.json_mode:
        out.emit(doc)
        return 0
    rows = [[d["bundle"], human_bytes(d["bytes"]), d["last_used"], "yes" if d["current"] else "changed or gone"]
            for d in doc["entries"]]
    out.table(["bundle", "size", "last used", "current"], rows, right=("size",))
    out.line(f"{len(rows)} unpacked bundle(s), {human_bytes(doc['bytes'])} of {human_bytes(doc['limit_bytes'])} "
             f"in {doc['cache']}")
    return 0


def run_clear(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.formats.bundle import clear_bundle_cache, default_cache_dir

    removed = clear_bundle_cache(bundle=args.bundle)
    doc: dict[str, Any] = {
        "cache": str(default_cache_dir()),
        "removed": [_doc(e) for e in removed],
        "bytes": sum(e.bytes for e in removed),
    }
    if out.json_mode:
        out.emit(doc)
        return 0
    for e in removed:
        out.line(f"removed {e.path} ({human_bytes(e.bytes)}, unpacked from {e.bundle})")
    out.line(f"removed {len(removed)} unpacked bundle(s), {human_bytes(doc['bytes'])}")
    return 0
