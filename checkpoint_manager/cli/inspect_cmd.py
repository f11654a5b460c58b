"""``ckpt inspect PATH``: a checkpoint's train state, metadata and tensors, without loading a tensor.

Everything shown comes from ``checkpoint.json`` and DCP's ``.metadata`` (read through the library's
allow-listed reader), so inspecting a 100 GB checkpoint costs a few small reads.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint_manager.cli.output import Output, human_bytes
from checkpoint_manager.cli.targets import existing, is_url, resolve_checkpoint, storage_options, tree_size
from checkpoint_manager.cli.tensors import TensorSource, name_filter, open_source

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  ckpt inspect runs/exp1/step_00001000
  ckpt inspect runs/exp1 --step 1000            a save directory: that step (default: the newest)
  ckpt inspect runs/exp1 --filter 'model.*'     only the model's tensors (glob)
  ckpt inspect ckpt.tar --filter 'exp_avg$' --regex
  ckpt inspect hf_export/                       safetensors weights too
  ckpt inspect s3://bucket/exp1 -o anon=false   a URL: reads checkpoint.json and .metadata only
  ckpt inspect runs/exp1 --json | jq '.tensors[] | select(.name == "model.lm_head.weight") | .shape'
"""

_META_KEYS = ("format_version", "library_version", "torch_version", "engine", "writer", "world_size")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="show a checkpoint's train state, metadata and tensors",
        description="Show a checkpoint's train state, metrics, metadata and tensors (name, shape, dtype, "
        "bytes). PATH is a checkpoint directory, a save directory (its newest checkpoint, or --step), "
        "a bundle, or safetensors weights.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--step", type=int, default=None, help="in a save directory: the checkpoint of this step")
    p.add_argument("--filter", default=None, metavar="PATTERN", help="only tensors whose name matches (glob)")
    p.add_argument("--regex", action="store_true", help="--filter is a regular expression (re.search)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, out: Output) -> int:
    match = name_filter(args.filter, regex=args.regex)
    if is_url(args.path):
        from checkpoint_manager.cli.remote import metadata_only, remote_checkpoint, remote_size

        remote = remote_checkpoint(args.path, storage_options(args), args.step)
        with metadata_only(remote) as local:
            source = open_source(local)
        info_meta = dict(remote.info.meta)
        return _show(args, out, match, source, remote.info.location, info_meta, remote.via,
                     remote_size(remote.storage, remote.info.name), len(info_meta.get("files") or {}))
    from checkpoint_manager.formats.hf import is_hf_weights

    given = existing(args.path)
    meta: dict[str, Any]
    via: str | None
    if is_hf_weights(given):
        path, meta, via = given, {}, "safetensors weights"
    else:
        ckpt = resolve_checkpoint(args.path, step=args.step, args=args)
        path, meta, via = ckpt.path, ckpt.meta, ckpt.via
    recorded = meta.get("files")  # plain DCP and safetensors record none: count what is there
    files = len(recorded) if isinstance(recorded, dict) and recorded else _count_files(path)
    return _show(args, out, match, open_source(path), str(path), meta, via, tree_size(path), files)


def _count_files(path: Path) -> int:
    if path.is_file():
        return 1
    return sum(len(names) for _dir, _dirs, names in os.walk(path))


def _show(
    args: argparse.Namespace,
    out: Output,
    match: Callable[[str], bool],
    source: TensorSource,
    where: str,
    meta: dict[str, Any],
    via: str | None,
    size: int,
    file_count: int,
) -> int:
    tensors = [t for t in source.tensors if match(t.name)]
    doc: dict[str, Any] = {
        "path": where,
        "via": via,
        "kind": source.kind,
        "name": meta.get("name", where.rstrip("/").rsplit("/", 1)[-1]),
        "step": meta.get("step"),
        "created": meta.get("created"),
        "train_state": meta.get("train_state"),
        "metrics": meta.get("metrics") or {},
        "meta": {k: meta[k] for k in _META_KEYS if k in meta},
        "files": meta.get("files") or {},
        "size_bytes": size,
        "file_count": file_count,
        "filter": args.filter,
        "tensors": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes} for t in tensors
        ],
        "tensor_count": len(tensors),
        "tensor_bytes": sum(t.nbytes for t in tensors),
    }
    if out.json_mode:
        out.emit(doc)
        return 0
    pairs = [("path", where + (f"  ({via})" if via else ""))]
    if doc["step"] is not None:
        pairs.append(("step", str(doc["step"])))
    if doc["created"]:
        pairs.append(("created", str(doc["created"])))
    pairs += [(k, str(v)) for k, v in doc["meta"].items()]
    pairs.append(("size", f"{human_bytes(doc['size_bytes'])} ({doc['size_bytes']} bytes, {file_count} files)"))
    out.fields(pairs)
    if doc["train_state"]:
        out.line()
        out.line("train state:")
        for key, value in doc["train_state"].items():
            out.line(f"  {key}: {value}")
    if doc["metrics"]:
        out.line()
        out.line("metrics:")
        for key, value in doc["metrics"].items():
            out.line(f"  {key}: {value}")
    out.line()
    rows = [[t.name, "[" + ", ".join(map(str, t.shape)) + "]", t.dtype, human_bytes(t.nbytes)] for t in tensors]
    out.table(["tensor", "shape", "dtype", "bytes"], rows, right=("bytes",))
    shown = f" matching {args.filter!r}" if args.filter else ""
    out.line(f"{len(tensors)} tensor(s){shown}, {human_bytes(doc['tensor_bytes'])}")
    return 0
