"""Command line for the formats: ``python -m checkpoint_manager.formats <command> ...``.

Every command is one call of the matching API function, so scripts and the CLI behave the same.
The ``ckpt`` command (:mod:`checkpoint_manager.cli`) offers the same operations as ``ckpt export``,
``convert``, ``pack``, ``unpack`` and ``list BUNDLE``, with ``--json`` and finer exit codes; this
older spelling keeps its arguments and its exit status (1 on any error) for existing scripts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from checkpoint_manager.errors import CheckpointError
from checkpoint_manager.formats.bundle import extract_bundle, list_bundle
from checkpoint_manager.formats.convert import convert
from checkpoint_manager.formats.hf import export_hf
from checkpoint_manager.formats.pack import pack_bundle

__all__ = ["build_parser", "main"]

_DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoint_manager.formats",
        description="Export, bundle and convert checkpoint-manager checkpoints.",
        epilog="The same operations, with --json and detailed exit codes: ckpt export | convert | pack | "
        "unpack | list BUNDLE (see ckpt --help).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export-hf", help="write a Hugging Face directory (safetensors) from a checkpoint")
    p.add_argument("checkpoint", help="committed checkpoint directory or bundle")
    p.add_argument("out", help="output directory")
    p.add_argument("--model-key", default="model", help="model section (model_0, ... for lists of models)")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="cast floating-point weights")
    p.add_argument("--artifacts-dir", default=None, help="config/tokenizer files to copy in")
    p.add_argument("--keep-tied", action="store_true", help="also write tied copies (e.g. lm_head)")
    p.add_argument("--overwrite", action="store_true")

    p = sub.add_parser("pack", help="pack a checkpoint (+ config, artifacts) into one tar file")
    p.add_argument("checkpoint")
    p.add_argument("bundle")
    p.add_argument("--artifacts-dir", default=None)
    p.add_argument("--config", default=None, help="a JSON/YAML CheckpointConfig file to include")
    p.add_argument("--compression", choices=("gz", "bz2", "xz"), default=None)
    p.add_argument("--overwrite", action="store_true")

    p = sub.add_parser("unpack", help="safely unpack a bundle into a new directory")
    p.add_argument("bundle")
    p.add_argument("dest")

    p = sub.add_parser("list", help="list a bundle's members (after the safety checks)")
    p.add_argument("bundle")

    p = sub.add_parser("convert", help="convert weights between dcp, safetensors and torch.save")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=("dcp", "safetensors", "torch"), required=True)
    p.add_argument("--model-key", default="model")
    p.add_argument("--dtype", choices=_DTYPES, default=None)
    p.add_argument("--subkey", default=None, help="torch.save sources: the entry holding the tensors")
    p.add_argument("--step", type=int, default=0, help="step recorded in a DCP target")
    p.add_argument("--overwrite", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export-hf":
            result = export_hf(
                args.checkpoint,
                args.out,
                model_key=args.model_key,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                artifacts_dir=args.artifacts_dir,
                tied_weights="keep" if args.keep_tied else "auto",
                overwrite=args.overwrite,
            )
            print(f"wrote {result.path}: {', '.join(result.files)} ({result.tensors} tensors, {result.bytes} bytes)")
        elif args.command == "pack":
            config = None
            if args.config is not None:
                from checkpoint_manager.config import CheckpointConfig

                config = CheckpointConfig.from_file(args.config)
            path = pack_bundle(
                args.checkpoint,
                args.bundle,
                config=config,
                artifacts_dir=args.artifacts_dir,
                compression=args.compression,
                overwrite=args.overwrite,
            )
            print(f"wrote {path}")
        elif args.command == "unpack":
            print(f"unpacked into {extract_bundle(args.bundle, args.dest)}")
        elif args.command == "list":
            print("\n".join(list_bundle(args.bundle)))
        else:
            out = convert(
                args.src,
                args.dst,
                to=args.to,
                model_key=args.model_key,
                dtype=args.dtype,
                step=args.step,
                subkey=args.subkey,
                overwrite=args.overwrite,
            )
            print(f"wrote {out}")
    except (CheckpointError, OSError, ValueError, KeyError) as exc:
        from checkpoint_manager.cli.errors import describe

        print(f"error: {describe(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
