"""``ckpt inspect PATH``: a checkpoint's summary, train state, metadata and tensors, without loading a tensor.

Everything shown comes from ``checkpoint.json``, ``state.json`` (plain JSON: optimizer and scheduler
settings) and the index of the engine that wrote the checkpoint (DCP's ``.metadata``, read through
the library's allow-listed reader), so inspecting a 100 GB DCP checkpoint costs a few small reads. A
bundle gives up those files and nothing else (every file, for an engine whose index needs them),
and nothing is left in the bundle cache.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.cli.output import Output, human_bytes
from checkpoint_manager.cli.targets import existing, is_url, resolve_checkpoint, storage_options, tree_size
from checkpoint_manager.cli.tensors import TensorInfo, TensorSource, name_filter, open_source

__all__ = ["add_parser", "run", "summarize"]

EPILOG = """\
examples:
  ckpt inspect runs/exp1/step_00001000
  ckpt inspect runs/exp1 --step 1000            a save directory: that step (default: the newest)
  ckpt inspect runs/exp1 --filter 'model.*'     only the model's tensors (glob)
  ckpt inspect ckpt.tar --filter 'exp_avg$' --regex
  ckpt inspect hf_export/                       safetensors weights too
  ckpt inspect s3://bucket/exp1 -o anon=false   a URL: reads checkpoint.json and the tensor index only
  ckpt inspect runs/exp1 --json | jq '.tensors[] | select(.name == "model.lm_head.weight") | .shape'
"""

_META_KEYS = ("format_version", "library_version", "torch_version", "engine", "writer", "world_size")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="show a checkpoint's summary, train state, metadata and tensors",
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
        from checkpoint_manager.cli.remote import metadata_only, remote_checkpoint

        remote = remote_checkpoint(args.path, storage_options(args), args.step)
        info_meta = dict(remote.info.meta)
        with metadata_only(remote) as local:
            source = open_source(local, meta=info_meta)
            state = _read_state(local)
        return _show(args, out, match, source, remote.info.location, info_meta, remote.via,
                     remote.storage.size_of(remote.info.location), len(info_meta.get("files") or {}), state)
    from checkpoint_manager.core.layout import read_checkpoint_json
    from checkpoint_manager.formats.bundle import is_bundle, read_bundle_metadata
    from checkpoint_manager.formats.hf import is_hf_weights

    given = existing(args.path)
    meta: dict[str, Any]
    via: str | None
    if is_hf_weights(given):
        path, meta, via = given, {}, "safetensors weights"
    elif given.is_file() and is_bundle(given):
        if args.step is not None:
            raise CliError(ExitCode.USAGE, f"{args.path}: --step applies to save directories, not bundles")
        with tempfile.TemporaryDirectory(prefix="ckpt-inspect-") as tmp:
            info = read_bundle_metadata(given, Path(tmp) / "bundle")
            meta = read_checkpoint_json(info.checkpoint)
            source, state = open_source(info.checkpoint), _read_state(info.checkpoint)
        return _show(args, out, match, source, str(given), meta, "bundle", given.stat().st_size,
                     len(meta.get("files") or {}), state)
    else:
        ckpt = resolve_checkpoint(args.path, step=args.step, args=args)
        path, meta, via = ckpt.path, ckpt.meta, ckpt.via
    recorded = meta.get("files")  # plain DCP and safetensors record none: count what is there
    files = len(recorded) if isinstance(recorded, dict) and recorded else _count_files(path)
    return _show(args, out, match, open_source(path), str(path), meta, via, tree_size(path), files,
                 _read_state(path))


def _count_files(path: Path) -> int:
    if path.is_file():
        return 1
    return sum(len(names) for _dir, _dirs, names in os.walk(path))


def _read_state(path: Path) -> dict[str, Any] | str | None:
    """``state.json`` decoded (tensors left as None), None if there is none, or what is wrong with it."""
    from checkpoint_manager.core.codec import decode
    from checkpoint_manager.core.layout import STATE_JSON, STATE_JSON_LIMIT
    from checkpoint_manager.core.safe_io import read_json
    from checkpoint_manager.errors import CheckpointCorruptError

    file = path / STATE_JSON
    if not path.is_dir() or not file.exists():
        return None
    try:
        data = decode(read_json(file, limit=STATE_JSON_LIMIT), tensor_hook=lambda placeholder: None)
    except CheckpointCorruptError as exc:  # names the file: damaged JSON, a FIFO, a symlink ...
        return str(exc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{file}: unreadable ({type(exc).__name__}: {exc})"
    return data if isinstance(data, dict) else f"{file}: holds a JSON {type(data).__name__}, not an object"


_SECTION = re.compile(r"^(model|optim|scheduler|extra|dataloader|rng)(?:_\d+)?$")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def summarize(source: TensorSource, state: dict[str, Any] | str | None, meta: dict[str, Any]) -> dict[str, Any]:
    """Parameter count, dtype mix, optimizer and scheduler settings and train state, from metadata only.

    Parameters are the model sections' tensors (``model.``, ``model_0.`` ...; every tensor of
    safetensors weights, or of a DCP checkpoint without such sections). Optimizer hyperparameters and
    scheduler settings come from ``state.json``; the optimizer's state slots from its tensors' keys.
    """
    tensors = source.tensors
    if source.kind == "safetensors":
        params = list(tensors)
    else:
        params = [t for t in tensors if re.fullmatch(r"model(_\d+)?", t.name.split(".", 1)[0])]
        if not params:
            params = [t for t in tensors if not _SECTION.match(t.name.split(".", 1)[0])]
    dtypes: dict[str, dict[str, int]] = {}
    for t in params:
        d = dtypes.setdefault(t.dtype, {"tensors": 0, "parameters": 0, "bytes": 0})
        d["tensors"] += 1
        d["parameters"] += _numel(t.shape)
        d["bytes"] += t.nbytes
    state_dict = state if isinstance(state, dict) else {}
    summary: dict[str, Any] = {
        "parameters": sum(d["parameters"] for d in dtypes.values()),
        "parameter_tensors": len(params),
        "parameter_bytes": sum(d["bytes"] for d in dtypes.values()),
        "dtypes": dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"])),
        "optimizers": _optimizers(tensors, state_dict),
        "schedulers": {k: _scheduler(v) for k, v in sorted(state_dict.items())
                       if re.fullmatch(r"scheduler(_\d+)?", k) and isinstance(v, dict)},
        "train_state": meta.get("train_state"),
    }
    if isinstance(state, str):
        summary["problems"] = [state]
    return summary


def _optimizers(tensors: list[TensorInfo], state: dict[str, Any]) -> dict[str, Any]:
    keys = {t.name.split(".", 1)[0] for t in tensors} | set(state)
    out: dict[str, Any] = {}
    for key in sorted(k for k in keys if re.fullmatch(r"optim(_\d+)?", k)):
        own = [t for t in tensors if t.name.startswith(f"{key}.state.")]
        found = state.get(key)
        saved: dict[str, Any] = found if isinstance(found, dict) else {}
        groups = []
        for group in saved.get("param_groups") or []:
            if isinstance(group, dict):
                settings = {k: v for k, v in group.items() if k != "params"}
                groups.append({"params": len(group.get("params") or []), **settings})
        out[key] = {
            "param_groups": groups,
            "slots": sorted({t.name.rsplit(".", 1)[1] for t in own}),
            "state_tensors": len(own),
            "state_bytes": sum(t.nbytes for t in own),
        }
    return out


def _scheduler(saved: dict[str, Any]) -> dict[str, Any]:
    """Its public settings and position (``last_epoch``), and the learning rates it last set."""
    settings = {k: v for k, v in saved.items() if not k.startswith("_")}
    if "_last_lr" in saved:
        settings["last_lr"] = saved["_last_lr"]
    return settings


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


def _settings(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in values.items() if v is not None)


def _summary_lines(out: Output, summary: dict[str, Any]) -> None:
    out.line()
    out.line("summary:")
    n = summary["parameters"]
    out.line(f"  parameters: {n:,} in {summary['parameter_tensors']} tensor(s), "
             f"{human_bytes(summary['parameter_bytes'])}")
    if n:
        mix = ", ".join(f"{dtype} {d['parameters'] / n:.1%}" for dtype, d in summary["dtypes"].items())
        out.line(f"  dtypes: {mix}")
    for key, opt in summary["optimizers"].items():
        slots = ", ".join(opt["slots"]) or "none"
        out.line(f"  {key}: {len(opt['param_groups'])} param group(s), state {slots} "
                 f"({human_bytes(opt['state_bytes'])})")
        for i, group in enumerate(opt["param_groups"]):
            out.line(f"    group {i}: {_settings(group)}")
    for key, sched in summary["schedulers"].items():
        out.line(f"  {key}: {_settings(sched)}")
    for problem in summary.get("problems", []):
        out.line(f"  problem: {problem}")


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
    state: dict[str, Any] | str | None,
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
        "summary": summarize(source, state, meta),
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
    _summary_lines(out, doc["summary"])
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
