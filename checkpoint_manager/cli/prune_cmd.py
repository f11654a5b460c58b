"""``ckpt prune DIR``: apply retention rules to a save directory after the fact.

The plan comes from the library's retention module (the same rules a run applies after each
commit): the newest checkpoint, the best by ``--monitor`` and whatever the ``latest``/``best``
pointers name are never deleted, and the pointers are left as the run wrote them. A ``--monitor``
no checkpoint logged is refused, and so is a ``--mode`` against the run's own (unless ``--force``).
A real pass takes the directory's writer lock, so it refuses to run while a training job writes
there. ``--dry-run`` only prints the plan.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.cli.output import Output, human_bytes
from checkpoint_manager.cli.targets import existing, is_url, storage_options

if TYPE_CHECKING:
    from checkpoint_manager.storage import Storage

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  ckpt prune runs/exp1 --keep-last 3 --dry-run          what would go
  ckpt prune runs/exp1 --keep-last 3                    delete all but the newest 3
  ckpt prune runs/exp1 --keep-last 2 --keep-best 2 --monitor val_loss --mode min
  ckpt prune runs/exp1 --keep-every 1000 --keep-last 1 --json
  ckpt prune s3://bucket/exp1 --keep-last 5 -o profile=training
the newest checkpoint, the best one by --monitor and the targets of the 'latest' and 'best'
pointers are always kept. Checkpoints a run abandoned by going back to an older one (superseded)
are kept by no rule. A --monitor that no checkpoint logged is refused (exit 2), and so is a --mode
that ranks the run's own metric the other way, unless --force.
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "prune",
        parents=[common],
        help="delete old checkpoints by retention rules (never the newest or the best)",
        description="Delete the checkpoints of a save directory that no rule keeps. A checkpoint "
        "survives if any rule keeps it; the newest, the best and the pointers' targets always survive.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the newest N")
    p.add_argument("--keep-best", type=int, default=None, metavar="N", help="keep the N best by --monitor")
    p.add_argument("--monitor", default=None, metavar="METRIC", help="metric that ranks checkpoints")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="lower (min) or higher (max) is better")
    p.add_argument("--keep-every", type=int, default=None, metavar="N", help="keep steps that are multiples of N")
    p.add_argument(
        "--keep-unranked", action="store_true", help="keep checkpoints whose --monitor is missing or NaN"
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.add_argument(
        "--force", action="store_true", help="rank with a --mode that disagrees with the one the run recorded"
    )
    p.set_defaults(run=run)


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (("--keep-last", args.keep_last), ("--keep-best", args.keep_best), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise CliError(ExitCode.USAGE, f"{flag} {value}: must be at least 1")
    if args.keep_last is None and args.keep_best is None and args.keep_every is None:
        raise CliError(ExitCode.USAGE, "prune needs a rule: --keep-last, --keep-best or --keep-every")
    if args.keep_best is not None and args.monitor is None:
        raise CliError(ExitCode.USAGE, "--keep-best needs --monitor (the metric that ranks checkpoints)")


def run(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.core.layout import CHECKPOINT_JSON
    from checkpoint_manager.lifecycle.retention import Pruner, build_retention_policy, prune
    from checkpoint_manager.storage import LocalStorage

    _check_counts(args)
    options = storage_options(args)
    if is_url(args.directory):
        from checkpoint_manager.cli.remote import open_remote

        where = args.directory.rstrip("/")
        storage: Storage = open_remote(where, options)
    else:
        root = existing(args.directory)
        if not root.is_dir():
            raise CliError(ExitCode.USAGE, f"{args.directory}: not a directory")
        if (root / CHECKPOINT_JSON).exists():
            raise CliError(ExitCode.USAGE, f"{args.directory}: is one checkpoint; prune takes its save directory")
        where = str(root)
        storage = LocalStorage(root, fsync=False)

    rules: dict[str, Any] = {
        "keep_last": args.keep_last,
        "keep_best": args.keep_best,
        "monitor": args.monitor,
        "mode": args.mode,
        "keep_unranked": args.keep_unranked,
        "keep_every_n_steps": args.keep_every,
    }
    policy = build_retention_policy(**rules)
    pruner = Pruner(storage, policy, monitor=args.monitor, mode=args.mode, owns_pointers=False, force=args.force)
    plan = pruner.prune(dry_run=True)  # refuses rules that do not fit the directory
    sizes = {c.name: storage.size_of(c.location) for c in plan.delete}
    files = _file_tables(storage, plan.delete)  # before anything is deleted: what each holds, by inode
    if args.dry_run:
        deleted_names = [c.name for c in plan.delete]
        failed: list[str] = []
    else:
        with out.progress("pruning", None):
            done = prune(args.directory, **rules, dry_run=False, force=args.force, storage_options=options)
        deleted_names = [c.name for c in done]
        remaining = {c.name for c in storage.scan()[0]}
        failed = [c.name for c in plan.delete if c.name not in deleted_names and c.name in remaining]
    steps = {c.name: c.step for c in [*plan.keep, *plan.delete]}
    superseded = {c.name for c in [*plan.keep, *plan.delete] if c.superseded}
    pointed = _pointer_names(storage)
    doc: dict[str, Any] = {
        "directory": where,
        "dry_run": bool(args.dry_run),
        "rules": {k: v for k, v in rules.items() if v not in (None, False)},
        "kept": [{"name": c.name, "step": c.step, "superseded": c.superseded,
                  "reasons": _reasons(plan.reasons.get(c.name, []), pointed.get(c.name, []))} for c in plan.keep],
        "deleted": [{"name": n, "step": steps.get(n), "superseded": n in superseded, "bytes": sizes.get(n, 0)}
                    for n in deleted_names],
        "failed": failed,
        "freed_bytes": _freed(deleted_names, sizes, files),
    }
    if out.json_mode:
        out.emit(doc)
    else:
        verb = "would delete" if args.dry_run else "deleted"
        for d in doc["deleted"]:
            note = ", superseded" if d["superseded"] else ""
            out.line(f"{verb} {d['name']} (step {d['step']}{note}, {human_bytes(d['bytes'])})")
        for k in doc["kept"]:
            note = "superseded; " if k["superseded"] else ""
            out.line(f"keep   {k['name']} (step {k['step']}: {note}{', '.join(k['reasons'])})")
        for name in failed:
            out.line(f"FAILED to delete {name} (see the log; retried at the next prune)")
        out.line(
            f"{verb} {len(doc['deleted'])} checkpoint(s), {human_bytes(doc['freed_bytes'])}; "
            f"kept {len(doc['kept'])}"
        )
    return ExitCode.IO_ERROR if failed else ExitCode.OK


def _pointer_names(storage: Storage) -> dict[str, list[str]]:
    """``{checkpoint name: ["latest pointer", ...]}``: why the library's "protected" applies."""
    from checkpoint_manager.lifecycle.pointers import BEST_POINTER, LATEST_POINTER

    out: dict[str, list[str]] = {}
    for kind in (LATEST_POINTER, BEST_POINTER):
        pointer = storage.read_pointer(kind)
        if pointer is not None:
            out.setdefault(pointer["name"], []).append(f"{kind} pointer")
    return out


def _reasons(raw: list[str], pointers: list[str]) -> list[str]:
    """``KeepLast(n=3)`` → ``keep-last 3``: the rule as it was typed on the command line."""
    out: list[str] = []
    for reason in raw:
        if reason == "protected":
            out.extend([p for p in pointers if p not in out] if pointers else ["protected"])
            continue
        head, _, rest = reason.partition("(")
        if not rest:
            out.append(reason)
            continue
        args = rest.rstrip(")").split(", ")
        values = [a.split("=", 1)[1].strip("'") for a in args if "=" in a]
        name = {"KeepLast": "keep-last", "KeepBest": "keep-best", "KeepEveryNSteps": "keep-every",
                "KeepUnranked": "keep-unranked"}.get(head, head)
        out.append(" ".join([name, *values[:1]]) if head != "KeepUnranked" else name)
    return out


def _file_tables(storage: Any, doomed: list[Any]) -> dict[str, Any] | None:
    """Each checkpoint's files by inode, on a local disk (None in an object store: no links there)."""
    if not storage.is_local:
        return None
    from pathlib import Path

    from checkpoint_manager.storage.local import file_table

    return {c.name: file_table(Path(c.location)) for c in doomed}


def _freed(deleted: list[str], sizes: dict[str, int], files: dict[str, Any] | None) -> int:
    """What the deletion frees: on a local disk a file hard-linked into a kept checkpoint (a shared
    frozen file, ``save_frozen="once"``) frees nothing; in an object store every object is its own."""
    if files is None:
        return sum(sizes.get(n, 0) for n in deleted)
    from checkpoint_manager.storage.local import freed_size

    return freed_size([files[n] for n in deleted if n in files])
