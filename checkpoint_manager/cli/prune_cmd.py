"""``ckpt prune DIR``: apply retention rules to a save directory after the fact.

The plan comes from the library's retention module (the same rules and the same code a run applies
after each commit): the newest checkpoint, the best by ``--monitor``, whatever the ``latest``/``best``
pointers name and every superseded checkpoint (unless ``--superseded``) are never deleted, and the
pointers are left as the run wrote them. Before anything is deleted, the checkpoints kept for those
reasons are checked (``--verify``): a damaged one is kept, named, and the next intact one is kept
too; the exit status then says a checkpoint is damaged. A ``--monitor`` no checkpoint logged is
refused, and so is one the run never ranked without ``--mode``, or a ``--mode`` against the run's own
(unless ``--force``). Nothing is deleted unasked: on a terminal the plan is shown and confirmed;
without one, ``--yes`` is needed. A real pass takes the directory's writer lock, so it refuses to run
while a training job writes there.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.cli.output import Output, human_bytes
from checkpoint_manager.cli.targets import existing, is_url, storage_options

if TYPE_CHECKING:
    from checkpoint_manager.lifecycle.retention import RetentionPlan
    from checkpoint_manager.storage import Storage

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  ckpt prune runs/exp1 --keep-last 3 --dry-run          what would go
  ckpt prune runs/exp1 --keep-last 3                    show the plan, ask, then delete
  ckpt prune runs/exp1 --keep-last 3 --yes              delete without asking (scripts, CI)
  ckpt prune runs/exp1 --keep-last 2 --keep-best 2 --monitor val_loss --mode min --yes
  ckpt prune runs/exp1 --superseded --yes               delete the lines a run abandoned
  ckpt prune runs/exp1 --keep-every 1000 --keep-last 1 --verify full --json --yes
  ckpt prune s3://bucket/exp1 --keep-last 5 -o profile=training --yes
always kept: the newest checkpoint, the best one by --monitor, the targets of the 'latest' and
'best' pointers and, unless --superseded, the checkpoints a run abandoned by going back to an older
one (superseded). Before deleting, the checkpoints kept as the newest, the best, a pointer's target
or one of the N of --keep-last/--keep-best are checked (--verify sizes, the default, or full: every
CRC32): a damaged one is kept and named, the next intact one is kept in its place, and the exit
status is 4. Without a terminal nothing is deleted unless --yes: the plan is printed and the exit
status is 2. --mode has no default: without it, the mode the run recorded for --monitor is used, and
a --monitor the run never ranked is refused (exit 2); so is a --monitor no checkpoint logged, and a
--mode that ranks the run's own metric the other way, unless --force.
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "prune",
        parents=[common],
        help="delete old checkpoints by retention rules (never the newest intact one or the best)",
        description="Delete the checkpoints of a save directory that no rule keeps. A checkpoint "
        "survives if any rule keeps it; the newest, the best, the pointers' targets and superseded "
        "checkpoints always survive, and a damaged one among them is replaced by the next intact one.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep the newest N")
    p.add_argument("--keep-best", type=int, default=None, metavar="N", help="keep the N best by --monitor")
    p.add_argument("--monitor", default=None, metavar="METRIC", help="metric that ranks checkpoints")
    p.add_argument(
        "--mode",
        choices=("min", "max"),
        default=None,
        help="lower (min) or higher (max) is better; no default: the mode the run recorded for --monitor, "
        "and a --monitor the run never ranked needs it",
    )
    p.add_argument("--keep-every", type=int, default=None, metavar="N", help="keep steps that are multiples of N")
    p.add_argument(
        "--keep-unranked", action="store_true", help="keep checkpoints whose --monitor is missing or NaN"
    )
    p.add_argument(
        "--superseded",
        action="store_true",
        help="also delete superseded checkpoints (a line a run abandoned by going back); kept otherwise",
    )
    p.add_argument(
        "--verify",
        choices=("sizes", "full"),
        default="sizes",
        help="how the checkpoints kept as newest, best or a pointer's target are checked before deleting "
        "(default: sizes; full reads every CRC32)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.add_argument("-y", "--yes", action="store_true", help="delete without asking (needed without a terminal)")
    p.add_argument(
        "--force", action="store_true", help="rank with a --mode that disagrees with the one the run recorded"
    )
    p.set_defaults(run=run)


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (("--keep-last", args.keep_last), ("--keep-best", args.keep_best), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise CliError(ExitCode.USAGE, f"{flag} {value}: must be at least 1")
    rules = (args.keep_last, args.keep_best, args.keep_every)
    if all(rule is None for rule in rules) and not args.superseded:
        raise CliError(ExitCode.USAGE, "prune needs a rule: --keep-last, --keep-best, --keep-every or --superseded")
    if args.keep_best is not None and args.monitor is None:
        raise CliError(ExitCode.USAGE, "--keep-best needs --monitor (the metric that ranks checkpoints)")


def run(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.core.layout import CHECKPOINT_JSON
    from checkpoint_manager.lifecycle.retention import build_pruner, prune
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
        "superseded": args.superseded,
    }
    # refuses rules that do not fit the directory; resolves the mode the run recorded
    pruner = build_pruner(storage, **rules, force=args.force, verify=args.verify)
    plan = pruner.prune(dry_run=True)
    sizes = {c.name: storage.size_of(c.location) for c in plan.delete}
    files = _file_tables(storage, plan.delete)  # before anything is deleted: what each holds, by inode
    shown = _document(where, rules, plan, storage, sizes, files, [c.name for c in plan.delete], [], dry_run=True)
    delete = not args.dry_run and bool(plan.delete)
    asked = False
    if delete and not args.yes:
        if not sys.stdin.isatty():
            _show(out, shown, verb="would delete")
            out.note(
                f"ckpt prune: nothing deleted: pass --yes to delete the {len(plan.delete)} checkpoint(s) "
                "above (there is no terminal to ask on)"
            )
            return ExitCode.USAGE
        _show(out, shown, verb="would delete", summary=False, document=False)
        if not _confirm(out, len(plan.delete), shown["freed_bytes"]):
            out.note("ckpt prune: nothing deleted")
            if out.json_mode:
                out.emit(shown)
            return _status(plan, [])
        asked = True
    if not delete:
        _show(out, dict(shown, dry_run=bool(args.dry_run)), verb="would delete" if args.dry_run else "deleted")
        return _status(plan, [])
    with out.progress("pruning", None):
        done = prune(
            args.directory,
            **dict(rules, mode=pruner.mode),
            dry_run=False,
            force=args.force or args.mode is None,  # a mode read from the run's own record agrees with it
            verify=args.verify,
            only={c.name for c in plan.delete},  # what was shown (and confirmed), never more
            storage_options=options,
        )
    deleted_names = [c.name for c in done]
    remaining = {c.name for c in storage.scan()[0]}
    failed = [c.name for c in plan.delete if c.name not in deleted_names and c.name in remaining]
    doc = _document(where, rules, plan, storage, sizes, files, deleted_names, failed, dry_run=False)
    _show(out, doc, verb="deleted", lines=not asked, notes=not asked)  # asked: the plan is on screen
    return _status(plan, failed)


def _status(plan: RetentionPlan, failed: list[str]) -> int:
    if failed:
        return ExitCode.IO_ERROR
    return ExitCode.CORRUPT if plan.damaged else ExitCode.OK


def _confirm(out: Output, count: int, nbytes: int) -> bool:
    """Ask on the terminal (the question on stderr: stdout may be a --json document)."""
    out.stderr.write(f"delete {count} checkpoint(s), {human_bytes(nbytes)}? [y/N] ")
    out.stderr.flush()
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _document(
    where: str,
    rules: dict[str, Any],
    plan: RetentionPlan,
    storage: Storage,
    sizes: dict[str, int],
    files: dict[str, Any] | None,
    deleted_names: list[str],
    failed: list[str],
    *,
    dry_run: bool,
) -> dict[str, Any]:
    steps = {c.name: c.step for c in [*plan.keep, *plan.delete]}
    superseded = {c.name for c in [*plan.keep, *plan.delete] if c.superseded}
    pointed = _pointer_names(storage)
    return {
        "directory": where,
        "dry_run": dry_run,
        "rules": {k: v for k, v in rules.items() if v not in (None, False)},
        "kept": [{"name": c.name, "step": c.step, "superseded": c.superseded,
                  "reasons": _reasons(plan.reasons.get(c.name, []), pointed.get(c.name, []))} for c in plan.keep],
        "deleted": [{"name": n, "step": steps.get(n), "superseded": n in superseded, "bytes": sizes.get(n, 0)}
                    for n in deleted_names],
        "failed": failed,
        "freed_bytes": _freed(deleted_names, sizes, files),
        "damaged": [{"name": n, "step": steps.get(n), "problem": problem} for n, problem in plan.damaged.items()],
    }


def _show(
    out: Output,
    doc: dict[str, Any],
    *,
    verb: str,
    lines: bool = True,
    notes: bool = True,
    summary: bool = True,
    document: bool = True,
) -> None:
    """The plan or its outcome: the JSON document, or one line per checkpoint and a summary."""
    if out.json_mode:
        if document:
            out.emit(doc)
        lines = summary = False
    if lines:
        for d in doc["deleted"]:
            note = ", superseded" if d["superseded"] else ""
            out.line(f"{verb} {d['name']} (step {d['step']}{note}, {human_bytes(d['bytes'])})")
        for k in doc["kept"]:
            note = "superseded; " if k["superseded"] and "superseded" not in k["reasons"] else ""
            out.line(f"keep   {k['name']} (step {k['step']}: {note}{', '.join(k['reasons'])})")
        for name in doc["failed"]:
            out.line(f"FAILED to delete {name} (see the log; retried at the next prune)")
    for d in doc["damaged"] if notes else []:
        out.note(f"ckpt prune: {d['name']} (step {d['step']}) is damaged and was kept: {d['problem']}")
    if summary:
        out.line(
            f"{verb} {len(doc['deleted'])} checkpoint(s), {human_bytes(doc['freed_bytes'])}; "
            f"kept {len(doc['kept'])}"
        )


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
                "KeepUnranked": "keep-unranked", "KeepAll": "the line"}.get(head, head)
        out.append(" ".join([name, *values[:1]]) if head not in ("KeepUnranked", "KeepAll") else name)
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
