"""``ckpt verify PATH|DIR``: recheck sizes and CRC32s recorded at save time (``checkpoint_manager.integrity``).

A save directory is verified checkpoint by checkpoint; one whose ``checkpoint.json`` is unreadable
counts as failed, since loading it would fail too. Exit 1 when anything failed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from checkpoint_manager.cli.errors import ExitCode
from checkpoint_manager.cli.output import Output
from checkpoint_manager.cli.targets import existing, resolve_checkpoint

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  ckpt verify runs/exp1/step_00001000      sizes and CRC32 of every file (default: --full)
  ckpt verify runs/exp1                    every committed checkpoint of a save directory
  ckpt verify runs/exp1 --sizes            only that every file exists with its size (fast)
  ckpt verify runs/exp1 --json && echo intact
exit status: 0 intact, 1 a problem was found, 3 no such path.
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify",
        parents=[common],
        help="check a checkpoint (or every checkpoint of a directory) against its recorded sizes/CRC32s",
        description="Check files against the sizes and CRC32s recorded in checkpoint.json.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", metavar="PATH|DIR")
    level = p.add_mutually_exclusive_group()
    level.add_argument(
        "--full", dest="level", action="store_const", const="full", help="sizes and CRC32s (the default)"
    )
    level.add_argument(
        "--sizes", dest="level", action="store_const", const="sizes", help="only sizes (no file is read)"
    )
    p.set_defaults(run=run, level="full")


def _targets(text: str) -> tuple[list[tuple[str, Path | None, list[str]]], bool]:
    """``(name, path, problems found before verifying)`` per checkpoint, and whether ``text`` is a save dir."""
    from checkpoint_manager.layout import CHECKPOINT_JSON, scan_checkpoints
    from checkpoint_manager.storage.local import LocalStorage

    path = existing(text)
    if path.is_file() or (path / CHECKPOINT_JSON).exists():
        ckpt = resolve_checkpoint(text)
        return [(ckpt.path.name, ckpt.path, [])], False
    names = LocalStorage(path).list_names()
    infos, bad = scan_checkpoints(path, names)
    out: list[tuple[str, Path | None, list[str]]] = [(i.name, i.path, []) for i in infos]
    out += [(name, None, [problem]) for name, problem in bad]
    if not out:
        from checkpoint_manager.cli.errors import CliError

        raise CliError(ExitCode.NOT_FOUND, f"{text}: no checkpoint here (not a checkpoint or save directory)")
    return out, True


def run(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.integrity import verify

    targets, is_dir = _targets(args.path)
    results: list[dict[str, Any]] = []
    with out.progress(f"verifying ({args.level})", len(targets)) as advance:
        for name, path, problems in targets:
            if path is not None:
                problems = problems + verify(path, args.level)
            results.append(
                {"name": name, "path": str(path) if path else None, "ok": not problems, "problems": problems}
            )
            advance(1)
    failed = [r for r in results if not r["ok"]]
    if out.json_mode:
        out.emit(
            {
                "path": args.path,
                "level": args.level,
                "ok": not failed,
                "checked": len(results),
                "failed": len(failed),
                "checkpoints": results,
            }
        )
    else:
        for r in results:
            out.line(f"{'ok    ' if r['ok'] else 'FAILED'} {r['name']}")
            for problem in r["problems"]:
                out.line(f"       {problem}")
        what = f"{len(results)} checkpoint(s)" if is_dir else "checkpoint"
        verdict = "intact" if not failed else f"{len(failed)} failed"
        out.line(f"{what} verified ({args.level}): {verdict}")
    return ExitCode.DIFFERENT if failed else ExitCode.OK
