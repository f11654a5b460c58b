"""``ckpt export``, ``convert``, ``pack`` and ``unpack``: checkpoints in and out of other formats.

Each is one call of the matching ``checkpoint_manager.formats`` function (the same ones the Python
API offers), so the shell and scripts produce identical files.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.cli.output import Output, human_bytes, io_meter
from checkpoint_manager.cli.targets import existing, resolve_checkpoint, tree_size

if TYPE_CHECKING:
    from checkpoint_manager.engine.reading import CheckpointTensors

__all__ = ["add_parsers"]

DTYPES = ("float32", "bfloat16", "float16")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")

EXPORT_EPILOG = """\
examples:
  ckpt export runs/exp1/step_00001000 --to hf --out hf_model --artifacts-dir tokenizer/
  ckpt export runs/exp1 --to hf --out hf_model --dtype bfloat16 --max-shard-size 2GB   (newest checkpoint)
  ckpt export runs/lora --to hf --out merged --merge-lora      (LoRA merged into the base weights)
  ckpt export runs/lora --to peft --out adapter               (PeftModel.from_pretrained(base, adapter))
  ckpt export runs/exp1 --step 500 --to safetensors --out weights/   -> weights/model.safetensors
  ckpt export runs/exp1 --to torch --out weights/model.pt
"""

CONVERT_EPILOG = """\
examples:
  ckpt convert runs/exp1/step_00001000 model.safetensors --to safetensors
  ckpt convert model.safetensors runs/imported --to dcp --step 0
  ckpt convert pretrained.pt runs/imported --to dcp --subkey state_dict
  ckpt convert runs/st/step_00000100 runs/as-dcp --to dcp          (any engine's checkpoint -> DCP, whole state)
  ckpt convert runs/exp1/step_00001000 runs/as-st --to dcp --engine safetensors   (and to another engine)
"""

PACK_EPILOG = """\
examples:
  ckpt pack runs/exp1/step_00001000 exp1-1000.tar --config exp1.yaml --artifacts-dir tokenizer/
  ckpt pack runs/exp1 exp1-latest.tar.gz --compression gz          (newest checkpoint)
  ckpt unpack exp1-1000.tar restored/
  ckpt list exp1-1000.tar                                          (members, after the safety checks)
"""


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "export",
        parents=[common],
        help="write a checkpoint's model as Hugging Face, safetensors or torch.save files",
        description="Export the model weights of a checkpoint. hf: a Hugging Face directory "
        "(model.safetensors or shards + index, tied copies dropped, config.json from --artifacts-dir or "
        "as recorded at save time, artifacts copied; --merge-lora for a PEFT model's checkpoint); "
        "peft: a PEFT model's adapter (adapter_model.safetensors + adapter_config.json); "
        "safetensors: one .safetensors file; torch: one torch.save file of {name: tensor}.",
        epilog=EXPORT_EPILOG,
        formatter_class=raw,
    )
    p.add_argument("path", metavar="PATH", help="checkpoint, save directory (newest or --step) or bundle")
    p.add_argument("--to", choices=("hf", "peft", "safetensors", "torch"), required=True)
    p.add_argument(
        "--out", required=True, metavar="DIR", help="output directory (or, for safetensors/torch, a file name)"
    )
    p.add_argument("--step", type=int, default=None, help="in a save directory: the checkpoint of this step")
    p.add_argument("--model-key", default="model", help="model section (model_0, ... for lists of models)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="cast floating-point weights")
    p.add_argument("--max-shard-size", default="5GB", help="hf: largest shard")
    p.add_argument("--artifacts-dir", default=None, help="hf: config/tokenizer files to copy in")
    p.add_argument("--keep-tied", action="store_true", help="hf: also write tied copies (e.g. lm_head)")
    p.add_argument(
        "--merge-lora", action="store_true", help="hf: merge the LoRA adapter into the base weights (base names)"
    )
    p.add_argument("--adapter-name", default=None, help="hf --merge-lora, peft: the adapter (default: the active one)")
    p.add_argument(
        "--adapter-config", default=None, metavar="FILE",
        help="hf --merge-lora: adapter_config.json, for a checkpoint that recorded none",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.set_defaults(run=run_export)

    p = sub.add_parser(
        "convert",
        parents=[common],
        help="convert weights between dcp, safetensors and torch.save; checkpoints between engines",
        description="Convert model weights from whatever SRC is (checkpoint of any engine, bundle, "
        "safetensors, torch.save file) to the format --to, written at DST. --to dcp writes a committed "
        "checkpoint with --engine (default dcp): from weights a model-only one, from a checkpoint of "
        "another engine the whole state.",
        epilog=CONVERT_EPILOG,
        formatter_class=raw,
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--to", choices=("dcp", "safetensors", "torch"), required=True)
    p.add_argument("--model-key", default="model")
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--subkey", default=None, help="torch.save sources: the entry holding the tensors")
    p.add_argument("--step", type=int, default=0, help="step recorded in a DCP target")
    p.add_argument(
        "--engine", default="dcp", metavar="NAME",
        help="--to dcp: the engine that writes the checkpoint (dcp, or an installed engine's name)",
    )
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(run=run_convert)

    p = sub.add_parser(
        "pack",
        parents=[common],
        help="pack a checkpoint (+ config, artifacts) into one tar file",
        description="Pack a committed checkpoint, optionally with its config and artifacts, into one "
        "tar bundle that every command (and the library's load) accepts in place of a directory.",
        epilog=PACK_EPILOG,
        formatter_class=raw,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint, or save directory (newest or --step)")
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--artifacts-dir", default=None)
    p.add_argument("--config", default=None, help="a JSON/YAML CheckpointConfig file to include")
    p.add_argument("--compression", choices=("gz", "bz2", "xz"), default=None)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(run=run_pack)

    p = sub.add_parser(
        "unpack",
        parents=[common],
        help="safely unpack a bundle into a new directory",
        description="Unpack a bundle into a new (or empty) directory after checking every member "
        "(no absolute paths, no '..', no links out, no devices).",
        epilog=PACK_EPILOG,
        formatter_class=raw,
    )
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("dest", metavar="DEST")
    p.set_defaults(run=run_unpack)


@contextlib.contextmanager
def _cli_errors() -> Iterator[None]:
    """The library speaks of ``overwrite=True``; on the command line that is ``--overwrite``."""
    from checkpoint_manager.errors import UnsupportedAdapterError

    try:
        yield
    except FileExistsError as exc:
        raise CliError(ExitCode.CONFLICT, str(exc).replace("overwrite=True", "--overwrite")) from exc
    except UnsupportedAdapterError as exc:  # the checkpoint is fine: the option does not fit it
        raise CliError(ExitCode.USAGE, str(exc)) from exc


def _weight_bytes(checkpoint: Path | CheckpointTensors, model_key: str | None, dtype: str | None) -> int | None:
    """Bytes of the tensors an export of ``model_key`` writes (after ``--dtype``), from the checkpoint's
    index alone; None when it cannot be told (the export itself then reports the problem)."""
    try:
        import torch

        from checkpoint_manager.formats.tensor_groups import open_checkpoint, tensor_entries

        cast = getattr(torch, dtype) if dtype is not None else None
        return sum(e.nbytes(cast) for e in tensor_entries(open_checkpoint(checkpoint), model_key))
    except Exception:  # a progress total is never worth failing the command for
        return None


def _plus(total: int | None, extra: str | None) -> int | None:
    """``total`` plus the bytes below the optional directory ``extra`` (artifacts, copied too)."""
    if total is None or extra is None or not Path(extra).exists():
        return total
    return total + tree_size(Path(extra))


def _bytes_progress(
    out: Output, description: str, total: int | None, kind: str
) -> contextlib.AbstractContextManager[Any]:
    """Progress of one library call in bytes ``kind`` ("read" or "write") of ``total``; where this
    system cannot count them, the time elapsed alone."""
    meter = io_meter(kind)
    if meter is None:
        return out.progress(description, None)
    return out.progress(description, total, unit="bytes", meter=meter)


def _out_file(out: str, name: str, suffixes: tuple[str, ...]) -> Path:
    path = Path(out)
    return path if path.name.endswith(suffixes) else path / name


def run_export(args: argparse.Namespace, out: Output) -> int:
    if args.to != "hf" and (args.merge_lora or args.adapter_config):
        raise CliError(ExitCode.USAGE, "--merge-lora and --adapter-config go with --to hf")
    if (args.adapter_config or (args.adapter_name and args.to == "hf")) and not args.merge_lora:
        raise CliError(ExitCode.USAGE, "--adapter-config and --adapter-name go with --merge-lora (or --to peft)")
    if args.adapter_name and args.to not in ("hf", "peft"):
        raise CliError(ExitCode.USAGE, "--adapter-name goes with --to hf --merge-lora or --to peft")
    from checkpoint_manager.formats.tensor_groups import open_checkpoint

    ckpt = resolve_checkpoint(args.path, step=args.step, args=args)
    doc: dict[str, Any] = {"source": ckpt.url or str(ckpt.path), "to": args.to, "step": ckpt.meta.get("step")}
    notes: list[str] = []
    source = open_checkpoint(ckpt.path)  # read through the engine that wrote it; its index once
    total = _weight_bytes(source, args.model_key, args.dtype)
    if args.to == "hf":
        total = _plus(total, args.artifacts_dir)
    with _cli_errors(), _bytes_progress(out, f"exporting {ckpt.path.name} ({args.to})", total, "write"):
        if args.to == "hf":
            from checkpoint_manager.formats.hf import MissingConfigWarning, export_hf

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MissingConfigWarning)  # said below, in the command's words
                result = export_hf(
                    source,
                    args.out,
                    model_key=args.model_key,
                    max_shard_size=args.max_shard_size,
                    dtype=args.dtype,
                    artifacts_dir=args.artifacts_dir,
                    tied_weights="keep" if args.keep_tied else "auto",
                    overwrite=args.overwrite,
                    merge_lora=args.merge_lora,
                    adapter_name=args.adapter_name,
                    adapter_config=args.adapter_config,
                )
            doc.update(
                path=str(result.path), files=list(result.files), tensors=result.tensors,
                bytes=tree_size(result.path), dropped=list(result.dropped), artifacts=list(result.artifacts),
                config=result.config, merged_adapter=result.merged_adapter, merged=result.merged,
            )
            if result.merged_adapter is not None:
                notes.append(f"merged LoRA adapter {result.merged_adapter!r} into {result.merged} weight(s)")
            if result.config is None:
                notes.append(
                    "no config.json written: the checkpoint recorded no Hugging Face config and no "
                    "--artifacts-dir gave one, so from_pretrained cannot load it yet (add --artifacts-dir DIR)"
                )
        elif args.to == "peft":
            from checkpoint_manager.formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_peft

            peft_result = export_peft(
                source, args.out, adapter_name=args.adapter_name, model_key=args.model_key,
                dtype=args.dtype, overwrite=args.overwrite,
            )
            doc.update(
                path=str(peft_result.path), files=[ADAPTER_WEIGHTS, ADAPTER_CONFIG],
                tensors=len(peft_result.tensors), bytes=tree_size(peft_result.path),
            )
        elif args.to == "safetensors":
            from checkpoint_manager.formats.convert import dcp_to_safetensors
            from checkpoint_manager.formats.safetensors_io import SafetensorsFile

            target = _out_file(args.out, "model.safetensors", (".safetensors",))
            path = dcp_to_safetensors(
                source, target, model_key=args.model_key, dtype=args.dtype, overwrite=args.overwrite
            )
            with SafetensorsFile(path) as st:
                tensors = len(st.keys())
            doc.update(path=str(path), files=[path.name], tensors=tensors, bytes=path.stat().st_size)
        else:
            from checkpoint_manager.formats.convert import dcp_to_torch
            from checkpoint_manager.formats.tensor_groups import tensor_entries

            target = _out_file(args.out, "model.pt", _TORCH_SUFFIXES)
            path = dcp_to_torch(source, target, model_key=args.model_key, dtype=args.dtype, overwrite=args.overwrite)
            tensors = len(tensor_entries(source, args.model_key))
            doc.update(path=str(path), files=[path.name], tensors=tensors, bytes=path.stat().st_size)
    if out.json_mode:
        out.emit({**doc, "notes": notes})
    else:
        out.line(
            f"wrote {doc['path']}: {', '.join(doc['files'])} ({doc['tensors']} tensors, "
            f"{doc['bytes']} bytes, {human_bytes(doc['bytes'])})"
        )
        for note in notes:
            out.line(note)
    return ExitCode.OK


def run_convert(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.formats.convert import convert, detect_format

    src = existing(args.src)
    kind = detect_format(src)
    if args.engine != "dcp" and args.to != "dcp":
        raise CliError(ExitCode.USAGE, "--engine goes with --to dcp (a checkpoint target)")
    if kind == "dcp":
        total = _weight_bytes(src, args.model_key, args.dtype)
    else:  # a safetensors or torch.save file: its size, unless a cast changes it
        total = tree_size(src) if args.dtype is None else None
    with _cli_errors(), _bytes_progress(out, f"converting {kind} -> {args.to}", total, "write"):
        path = convert(
            src, args.dst, to=args.to, model_key=args.model_key, dtype=args.dtype, step=args.step,
            subkey=args.subkey, overwrite=args.overwrite, engine=args.engine,
        )
    doc: dict[str, Any] = {"source": str(src), "from": kind, "to": args.to, "path": str(path), "bytes": tree_size(path)}
    written_by = ""
    if args.to == "dcp":  # a checkpoint: the engine that wrote it
        from checkpoint_manager.core.layout import read_checkpoint_json

        doc["engine"] = read_checkpoint_json(path).get("engine")
        written_by = f", engine {doc['engine']}"
    if out.json_mode:
        out.emit(doc)
    else:
        out.line(f"wrote {path} ({kind} -> {args.to}{written_by}, {human_bytes(doc['bytes'])})")
    return ExitCode.OK


def run_pack(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.formats.pack import pack_bundle

    ckpt = resolve_checkpoint(args.checkpoint, step=args.step, args=args)
    if ckpt.via == "bundle":
        raise CliError(ExitCode.USAGE, f"{args.checkpoint}: is already a bundle")
    config = None
    if args.config is not None:
        from checkpoint_manager.config import CheckpointConfig

        existing(args.config)
        config = CheckpointConfig.from_file(args.config)
    total = _plus(tree_size(ckpt.path), args.artifacts_dir)  # what is read, compressed or not
    with _cli_errors(), _bytes_progress(out, f"packing {ckpt.path.name}", total, "read"):
        path = pack_bundle(
            ckpt.path, args.bundle, config=config, artifacts_dir=args.artifacts_dir,
            compression=args.compression, overwrite=args.overwrite,
        )
    doc: dict[str, Any] = {"source": ckpt.url or str(ckpt.path), "step": ckpt.meta.get("step"), "path": str(path), "bytes": path.stat().st_size}
    if out.json_mode:
        out.emit(doc)
    else:
        out.line(f"wrote {path} (step {doc['step']}, {human_bytes(doc['bytes'])})")
    return ExitCode.OK


def run_unpack(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.formats.bundle import extract_bundle, list_bundle

    bundle = existing(args.bundle)
    members = list_bundle(bundle)  # every member checked (names, kinds, depth, count, size) first
    with _bytes_progress(out, f"unpacking {bundle.name}", _members_bytes(bundle), "write"):
        dest = extract_bundle(bundle, args.dest)
    doc: dict[str, Any] = {"bundle": str(bundle), "path": str(dest), "members": members, "bytes": tree_size(dest)}
    if out.json_mode:
        out.emit(doc)
    else:
        out.line(f"unpacked into {dest} ({len(members)} entries, {human_bytes(doc['bytes'])})")
    return ExitCode.OK


def _members_bytes(bundle: Path) -> int | None:
    """Bytes an uncompressed bundle unpacks to, from its headers (a compressed one would have to be
    decompressed once more to tell: None)."""
    import tarfile

    try:
        with tarfile.open(bundle, "r:") as tar:
            return sum(m.size for m in tar.getmembers() if m.isfile())
    except (tarfile.TarError, OSError):
        return None
