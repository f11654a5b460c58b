"""``ckpt list DIR``: every checkpoint of a save directory with its state, size, metrics and pointers.

Committed checkpoints come from the library's own discovery (``scan_checkpoints``); what discovery
skips is shown too, because that is what people are looking for when something went wrong:
committed checkpoints a later run abandoned by going back to an older one (``superseded``),
directories whose ``checkpoint.json`` is damaged or missing (``corrupt``), saves still in
``.pending/`` (``pending``) and deletions under way (``deleting``). With ``--verify``, a checkpoint
deleted while it was being verified (a running job's retention) is ``gone``, not ``corrupt``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.cli.output import Output, human_bytes, io_meter
from checkpoint_manager.cli.targets import existing, is_url, storage_options, tree_size

__all__ = ["add_parser", "collect", "run"]

EPILOG = """\
examples:
  ckpt list runs/exp1                 table of checkpoints, newest last
  ckpt list runs/exp1 --verify sizes  also check every recorded file's size
  ckpt list runs/exp1 --json | jq '.checkpoints[] | select(.state == "committed") | .step'
  ckpt list model.tar                 the members of a bundle
  ckpt list s3://bucket/exp1 -o 'client_kwargs={"endpoint_url": "http://localhost:9000"}'
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "list",
        parents=[common],
        help="list the checkpoints of a save directory (or a bundle's members)",
        description="List the checkpoints of a save directory: step, name, time, size, metrics, "
        "state (committed, pending, corrupt) and the latest/best pointers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", metavar="DIR", help="a save directory, or a bundle (.tar) file")
    p.add_argument(
        "--verify",
        choices=("sizes", "full"),
        default=None,
        help="also verify each committed checkpoint (sizes: quick; full: CRC32 of every file)",
    )
    p.set_defaults(run=run)


def _row(
    name: str,
    path: Path | str,
    state: str,
    *,
    step: int | None = None,
    meta: dict[str, Any] | None = None,
    size: int | None = None,
) -> dict[str, Any]:
    meta = meta or {}
    metrics = meta.get("metrics")
    return {
        "name": name,
        "path": str(path),
        "step": step,
        "state": state,
        "created": meta.get("created"),
        "created_unix": meta.get("created_unix"),
        "size_bytes": size if size is not None else tree_size(Path(path)),
        "metrics": dict(metrics) if isinstance(metrics, dict) else {},
        "pointers": [],
        "problems": [],
    }


def collect(root: Path, verify_level: str | None, out: Output) -> dict[str, Any]:
    """The listing of ``root`` as one JSON-able document (what ``--json`` prints)."""
    from checkpoint_manager.core.layout import (
        CHECKPOINT_JSON,
        PENDING_DIR,
        STATE_JSON,
        rank_file,
        read_checkpoint_json,
        scan_checkpoints,
    )
    from checkpoint_manager.core.naming import BEST_POINTER, LATEST_POINTER
    from checkpoint_manager.engine.reading import plain_engine
    from checkpoint_manager.errors import CheckpointCorruptError
    from checkpoint_manager.storage.base import deleted_name
    from checkpoint_manager.storage.local import LocalStorage

    storage = LocalStorage(root)
    names = storage.list_names()
    infos, bad = scan_checkpoints(root, names)
    rows: list[dict[str, Any]] = []
    for info in infos:
        state = "superseded" if info.superseded else "committed"
        rows.append(_row(info.name, info.path, state, step=info.step, meta=dict(info.meta)))
    for name, problem in bad:
        row = _row(name, root / name, "corrupt")
        row["problems"].append(problem)
        rows.append(row)
    seen = {r["name"] for r in rows}
    for name in names:  # a checkpoint's files but no checkpoint.json: a save that never committed in place
        path = root / name
        ours = (path / STATE_JSON).exists() or (path / rank_file(0)).exists() or plain_engine(path) is not None
        if name not in seen and not (path / CHECKPOINT_JSON).exists() and ours:
            row = _row(name, path, "corrupt")
            row["problems"].append(f"{path / CHECKPOINT_JSON}: missing (not a committed checkpoint)")
            rows.append(row)
    pending_root = root / PENDING_DIR
    if pending_root.is_dir():
        with os.scandir(pending_root) as it:
            entries = sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        for entry in entries:
            deleted = deleted_name(entry)
            state = "deleting" if deleted is not None else "pending"
            base = deleted if deleted is not None else entry.rsplit(".", 1)[0]
            meta: dict[str, Any] = {}
            with contextlib.suppress(CheckpointCorruptError, OSError):  # none until its last moment
                meta = read_checkpoint_json(pending_root / entry)
            step = meta.get("step") if isinstance(meta.get("step"), int) else None
            row = _row(base, pending_root / entry, state, step=step, meta=meta)
            rows.append(row)

    return _finish(str(root), rows, storage.read_pointer(LATEST_POINTER), storage.read_pointer(BEST_POINTER),
                   verify_level, out, lambda row, level: _verify_local(Path(row["path"]), level))


def _verify_local(path: Path, level: str) -> list[str]:
    from checkpoint_manager.cli.verify_cmd import local_problems

    return local_problems(path, level)


def collect_remote(url: str, options: dict[str, Any] | None, verify_level: str | None, out: Output) -> dict[str, Any]:
    """The listing of a save root at an fsspec URL (committed and damaged checkpoints; pending
    saves live on the writer's machine, not in the store)."""
    from checkpoint_manager.cli.remote import open_remote
    from checkpoint_manager.core.naming import BEST_POINTER, LATEST_POINTER

    storage = open_remote(url.rstrip("/"), options)
    infos, bad = storage.scan()
    if not infos and not bad and not storage.is_present():
        raise CliError(ExitCode.NOT_FOUND, f"{url}: nothing stored there")
    rows = [
        _row(i.name, i.location, "superseded" if i.superseded else "committed", step=i.step, meta=dict(i.meta),
             size=storage.size_of(i.location))
        for i in infos
    ]
    for name, problem in bad:
        row = _row(name, storage.location_of(name), "corrupt", size=storage.size_of(storage.location_of(name)))
        row["problems"].append(problem)
        rows.append(row)

    return _finish(url, rows, storage.read_pointer(LATEST_POINTER), storage.read_pointer(BEST_POINTER),
                   verify_level, out, lambda row, level: storage.verify(row["path"], level))  # type: ignore[arg-type]


_COMMITTED = ("committed", "superseded")  # both are listed by discovery; superseded ones are never auto-loaded


def _finish(
    where: str,
    rows: list[dict[str, Any]],
    latest: dict[str, Any] | None,
    best: dict[str, Any] | None,
    verify_level: str | None,
    out: Output,
    check: Callable[[dict[str, Any], str], list[str]],
) -> dict[str, Any]:
    """Pointers marked, verification done if asked, rows ordered: the document ``--json`` prints."""
    for row in rows:
        if row["state"] not in _COMMITTED:
            continue
        if latest is not None and latest["name"] == row["name"]:
            row["pointers"].append("latest")
        if best is not None and best["name"] == row["name"]:
            row["pointers"].append("best")

    if verify_level is not None:
        from checkpoint_manager.errors import CheckpointNotFoundError

        committed = [r for r in rows if r["state"] in _COMMITTED]
        progress = out.progress("verifying", len(committed))
        meter = io_meter("read")
        if verify_level == "full" and not is_url(where) and meter is not None:  # every byte read: bytes, ETA
            total = sum(r["size_bytes"] for r in committed)
            progress = out.progress("verifying", total, unit="bytes", meter=meter)
        with progress as advance:
            for row in committed:
                try:
                    problems = check(row, verify_level)
                except CheckpointNotFoundError:  # a running job's retention deleted it meanwhile
                    row["state"] = "gone"
                    advance(1)
                    continue
                if problems:
                    row["state"] = "corrupt"
                    row["problems"].extend(problems)
                advance(1)

    order = {"committed": 0, "superseded": 0, "corrupt": 0, "pending": 1, "deleting": 2, "gone": 2}
    rows.sort(key=lambda r: (order[r["state"]], r["step"] if r["step"] is not None else -1, r["name"]))
    return {
        "directory": where,
        "checkpoints": rows,
        "latest": latest,
        "best": best,
        "committed": sum(r["state"] in _COMMITTED for r in rows),
        "total_bytes": sum(r["size_bytes"] for r in rows),
        "verified": verify_level,
    }


def _metrics_text(metrics: dict[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        parts.append(f"{key}={value:.6g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


def _time_text(created: Any) -> str:
    return created.replace("T", " ").removesuffix("Z") if isinstance(created, str) else ""


def run(args: argparse.Namespace, out: Output) -> int:
    if is_url(args.directory):
        doc = collect_remote(args.directory, storage_options(args), args.verify, out)
        return _render(doc, args, out, args.directory)
    root = existing(args.directory)
    if root.is_file():
        return _list_bundle(root, args, out)
    from checkpoint_manager.core.layout import CHECKPOINT_JSON

    if (root / CHECKPOINT_JSON).exists():
        raise CliError(
            ExitCode.USAGE,
            f"{args.directory}: is one checkpoint, not a save directory (try: ckpt inspect {args.directory})",
        )
    doc = collect(root, args.verify, out)
    if not doc["checkpoints"] and not looks_like_save_dir(root):
        raise CliError(
            ExitCode.NOT_FOUND,
            f"{args.directory}: no checkpoints, and not a save directory (none of {', '.join(_save_dir_entries())})",
        )
    return _render(doc, args, out, str(root))


# What a manager leaves in its save_dir besides checkpoints: the in-progress area, the pointers and
# the writer lock's files. A directory holding other things but none of these (and no checkpoint)
# is most likely the wrong path; an empty one is a save directory before its first save.
def _save_dir_entries() -> tuple[str, ...]:
    from checkpoint_manager.core.layout import PENDING_DIR
    from checkpoint_manager.core.naming import BEST_POINTER, LATEST_POINTER
    from checkpoint_manager.storage.lock import GUARD_FILE, LOCK_FILE

    return (PENDING_DIR, LATEST_POINTER, BEST_POINTER, LOCK_FILE, GUARD_FILE)


def looks_like_save_dir(root: Path) -> bool:
    """Whether ``root`` is empty or holds something a checkpoint manager writes there."""
    with os.scandir(root) as it:
        if next(it, None) is None:
            return True
    return any(os.path.lexists(root / name) for name in _save_dir_entries())


def _render(doc: dict[str, Any], args: argparse.Namespace, out: Output, where: str) -> int:
    if out.json_mode:
        out.emit(doc)
    else:
        rows = [
            [
                "" if r["step"] is None else str(r["step"]),
                r["name"],
                _time_text(r["created"]),
                human_bytes(r["size_bytes"]),
                _metrics_text(r["metrics"]),
                r["state"],
                ",".join(r["pointers"]),
            ]
            for r in doc["checkpoints"]
        ]
        if not rows:
            out.line(f"no checkpoints in {where} yet")
        else:
            out.table(
                ["step", "name", "time", "size", "metrics", "state", "pointers"], rows, right=("step", "size")
            )
            out.line(
                f"{doc['committed']} committed checkpoint(s), {human_bytes(doc['total_bytes'])} in {where}"
            )
        for r in doc["checkpoints"]:
            for problem in r["problems"]:
                out.line(f"{r['name']}: {problem}")
    corrupt = any(r["state"] == "corrupt" for r in doc["checkpoints"])
    if corrupt and args.verify is not None:
        return ExitCode.DIFFERENT  # as ckpt verify: a problem found
    return ExitCode.CORRUPT if corrupt else ExitCode.OK  # every entry listed, the damaged ones too


def _list_bundle(path: Path, args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.formats.bundle import is_bundle, list_bundle

    if not is_bundle(path):
        raise CliError(ExitCode.USAGE, f"{args.directory}: a file, but not a checkpoint bundle (.tar)")
    members = list_bundle(path)
    if out.json_mode:
        out.emit({"bundle": str(path), "members": members})
    else:
        for name in members:
            out.line(name)
    return ExitCode.OK
