"""The ``ckpt`` entry point: the parser, the dispatch, and one place that turns errors into exit codes.

Command modules are imported here but import torch and the heavy parts of the library only when
they run, so ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Sequence

from checkpoint_manager.cli import (
    cache_cmd,
    diff_cmd,
    inspect_cmd,
    list_cmd,
    prune_cmd,
    transfer_cmd,
    verify_cmd,
)
from checkpoint_manager.cli.errors import ExitCode, classify, describe
from checkpoint_manager.cli.output import Output

__all__ = ["build_parser", "main"]

PROG = "ckpt"

EPILOG = """\
examples:
  ckpt list runs/exp1                               checkpoints, sizes, metrics, latest/best
  ckpt inspect runs/exp1 --filter 'model.*'         train state and tensors of the newest
  ckpt verify runs/exp1                             CRC32 of every file of every checkpoint
  ckpt diff runs/exp1/step_00000100 runs/exp1/step_00000200
  ckpt export runs/exp1 --to hf --out hf_model
  ckpt prune runs/exp1 --keep-last 3 --dry-run
  ckpt cache clear                                  remove the unpacked copies of bundles
  ckpt list runs/exp1 --json                        one JSON document on stdout, for scripts

exit status:
  0 ok   1 differences found / verification failed   2 usage error   3 not found
  4 unreadable or corrupt checkpoint   5 output exists or directory locked by a running job
  6 other I/O error   130 interrupted
Run 'ckpt COMMAND --help' for a command's options and examples.
"""


def _common() -> argparse.ArgumentParser:
    """Options every command takes (after the command name as well as before it)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS,
        help="print one JSON document on stdout (and nothing else there)",
    )
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error"
    )
    common.add_argument(
        "-o", "--storage-option", action="append", default=argparse.SUPPRESS, metavar="KEY=VALUE",
        help="fsspec option for URLs (repeatable; JSON values allowed, e.g. -o anon=true)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, compare, export and prune checkpoint-manager checkpoints.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument(
        "-o", "--storage-option", action="append", default=None, metavar="KEY=VALUE",
        help="fsspec option for URLs (repeatable)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common()
    list_cmd.add_parser(sub, common)
    inspect_cmd.add_parser(sub, common)
    verify_cmd.add_parser(sub, common)
    diff_cmd.add_parser(sub, common)
    transfer_cmd.add_parsers(sub, common)
    prune_cmd.add_parser(sub, common)
    cache_cmd.add_parser(sub, common)
    return parser


def _version() -> str:
    from checkpoint_manager._version import __version__

    return str(__version__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see ``ckpt --help``)."""
    args = build_parser().parse_args(argv)
    out = Output(json_mode=args.json)
    try:
        with contextlib.ExitStack() as cleanup:  # downloaded copies of remote checkpoints
            args.cleanup = cleanup
            code = int(args.run(args, out))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `ckpt list DIR | head`: the reader has all it wanted
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK
    except BaseException as exc:  # every error (DCP's CheckpointException is a BaseException): one line
        if isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        if args.debug:
            traceback.print_exc()
        print(f"{PROG} {args.command}: error: {describe(exc)}", file=sys.stderr)
        return int(classify(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
