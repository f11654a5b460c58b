"""``ckpt verify PATH|DIR``: recheck sizes and CRC32s recorded at save time (``checkpoint_manager.core.integrity``).

A save directory is verified checkpoint by checkpoint; one whose ``checkpoint.json`` is unreadable
counts as failed, since loading it would fail too. One that a running job's retention deletes while
it is being verified is reported as gone and skipped, not failed. Exit 1 when anything failed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.cli.output import Output, io_meter
from checkpoint_manager.cli.targets import existing, is_url, resolve_checkpoint, storage_options, tree_size

__all__ = ["add_parser", "local_problems", "run"]

EPILOG = """\
examples:
  ckpt verify runs/exp1/step_00001000      sizes and CRC32 of every file (default: --full)
  ckpt verify runs/exp1                    every committed checkpoint of a save directory
  ckpt verify runs/exp1 --sizes            only that every file exists with its size (fast)
  ckpt verify runs/exp1 --json && echo intact
  ckpt verify s3://bucket/exp1 --sizes     sizes from one listing, nothing downloaded
  ckpt verify runs/exp1 --finite           also read every tensor and report NaN / inf values
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
        "--sizes", dest="level", action="store_const", const="sizes", help="sizes, and CRC32s of the small files a load reads whole (no tensor file is read)"
    )
    p.add_argument(
        "--finite",
        action="store_true",
        help="also read every tensor (local checkpoints) and report those holding NaN or inf",
    )
    p.set_defaults(run=run, level="full")


Target = tuple[str, str, list[str], Callable[[str], list[str]] | None]


def _targets(text: str, args: argparse.Namespace) -> tuple[list[Target], bool]:
    """``(name, where, problems found already, check(level))`` per checkpoint; and whether ``text`` is a
    save directory. A checkpoint whose ``checkpoint.json`` is unreadable has no check: it failed."""
    from checkpoint_manager.core.layout import CHECKPOINT_JSON, scan_checkpoints
    from checkpoint_manager.storage.local import LocalStorage

    if is_url(text):
        return _remote_targets(text, args)
    path = existing(text)
    if path.is_file() or (path / CHECKPOINT_JSON).exists():
        ckpt = resolve_checkpoint(text, args=args)
        return [(ckpt.path.name, str(ckpt.path), [], _check(ckpt.path))], False
    from checkpoint_manager.formats.resolve import is_plain_dcp

    if is_plain_dcp(path):
        raise CliError(
            ExitCode.USAGE,
            f"{text}: a plain DCP directory records no sizes or checksums to verify "
            "(ckpt convert ... --to dcp makes a checkpoint of ours that does)",
        )
    infos, bad = scan_checkpoints(path, LocalStorage(path).list_names())
    out: list[Target] = [(i.name, str(i.path), [], _check(i.path)) for i in infos if i.path is not None]
    out += [(name, str(path / name), [problem], None) for name, problem in bad]
    out += [(name, str(path / name), [problem], None) for name, problem in _linked_entries(path)]
    if not out:
        raise CliError(ExitCode.NOT_FOUND, f"{text}: no checkpoint here (not a checkpoint or save directory)")
    return out, True


def local_problems(path: Path, level: str) -> list[str]:
    """Sizes and CRC-32s, then (when they pass) what a load would refuse beyond them: what ``ckpt
    verify`` and ``ckpt list --verify`` report of a local checkpoint."""
    from checkpoint_manager.core.integrity import verify
    from checkpoint_manager.lifecycle.readable import load_problems

    return verify(path, level) or load_problems(path, level)  # type: ignore[arg-type]


def _check(path: Path) -> Callable[[str], list[str]]:
    return lambda level: local_problems(path, level)


def _linked_entries(root: Path) -> list[tuple[str, str]]:
    """Entries of a save directory that are symlinks to checkpoints: discovery never takes them (a
    symlink there could point anywhere), so auto-resume, ``step=`` and retention never see them."""
    import os

    from checkpoint_manager.core.layout import CHECKPOINT_JSON

    found = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_symlink() and not entry.name.startswith(".") and (Path(entry.path) / CHECKPOINT_JSON).exists():
            found.append((entry.name, f"{entry.path}: a symlink (to {os.readlink(entry.path)!r}), not a checkpoint "
                          "directory: a load from this save directory never uses it"))
    return found


def _remote_targets(url: str, args: argparse.Namespace) -> tuple[list[Target], bool]:
    """Sizes from a listing (nothing downloaded); ``--full`` downloads each checkpoint to check CRC32s."""
    from checkpoint_manager.cli.remote import open_remote, remote_checkpoint
    from checkpoint_manager.storage import Storage

    options = storage_options(args)
    storage = open_remote(url.rstrip("/"), options)
    infos, bad = storage.scan()
    is_dir = bool(infos or bad)
    if not is_dir:
        single = remote_checkpoint(url, options, None)
        storage, infos = single.storage, [single.info]

    def checker(store: Storage, location: str) -> Callable[[str], list[str]]:
        return lambda level: store.verify(location, level)  # type: ignore[arg-type]

    out: list[Target] = [(i.name, i.location, [], checker(storage, i.location)) for i in infos]
    out += [(name, storage.location_of(name), [problem], None) for name, problem in bad]
    return out, is_dir


def run(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.errors import CheckpointNotFoundError

    targets, is_dir = _targets(args.path, args)
    results: list[dict[str, Any]] = []
    progress = out.progress(f"verifying ({args.level})", len(targets))
    meter = io_meter("read")
    if args.level == "full" and not is_url(args.path) and meter is not None:  # every byte read: bytes, ETA
        total = sum(tree_size(Path(where)) for _name, where, _problems, check in targets if check is not None)
        progress = out.progress(f"verifying ({args.level})", total, unit="bytes", meter=meter)
    with progress as advance:
        for name, where, problems, check in targets:
            gone = False
            if check is not None:
                try:
                    problems = problems + check(args.level)
                    if getattr(args, "finite", False) and not problems:
                        problems = problems + _nonfinite_problems(where)
                except CheckpointNotFoundError as exc:  # pruned meanwhile: gone, not damaged
                    if not is_dir:
                        raise CliError(ExitCode.NOT_FOUND, str(exc)) from exc
                    gone = True
            results.append({"name": name, "path": where, "ok": not problems, "gone": gone, "problems": problems})
            advance(1)
    vanished = [r for r in results if r["gone"]]
    results = [r for r in results if not r["gone"]]
    failed = [r for r in results if not r["ok"]]
    if out.json_mode:
        out.emit(
            {
                "path": args.path,
                "level": args.level,
                "ok": not failed,
                "checked": len(results),
                "failed": len(failed),
                "gone": [r["name"] for r in vanished],
                "checkpoints": results,
            }
        )
    else:
        for r in results:
            out.line(f"{'ok    ' if r['ok'] else 'FAILED'} {r['name']}")
            for problem in r["problems"]:
                out.line(f"       {problem}")
        for r in vanished:
            out.line(f"gone   {r['name']} (deleted while being verified: pruned by a running job?)")
        what = f"{len(results)} checkpoint(s)" if is_dir else "checkpoint"
        verdict = "intact" if not failed else f"{len(failed)} failed"
        skipped = f" ({len(vanished)} deleted meanwhile, skipped)" if vanished else ""
        out.line(f"{what} verified ({args.level}): {verdict}{skipped}")
    return ExitCode.DIFFERENT if failed else ExitCode.OK


# Tensors read at once by --finite: bounds the memory of a check to about this many bytes.
_FINITE_BATCH_BYTES = 256 << 20


def _nonfinite_problems(where: str) -> list[str]:
    """One problem per tensor of the checkpoint at ``where`` that holds NaN or inf."""
    from pathlib import Path

    from checkpoint_manager.cli.tensors import open_source
    from checkpoint_manager.lifecycle.finite import nonfinite_tensors

    if is_url(where):
        return ["--finite reads tensors of local checkpoints only (download it first: ckpt unpack / convert)"]
    source = open_source(Path(where))
    found: list[str] = []
    batch: list[str] = []
    size = 0
    for info in [*source.tensors, None]:
        if info is not None:
            batch.append(info.name)
            size += info.nbytes
        if batch and (info is None or size >= _FINITE_BATCH_BYTES):
            found += nonfinite_tensors(source.read(batch))
            batch, size = [], 0
    return [f"{name}: holds NaN or inf" for name in found]
