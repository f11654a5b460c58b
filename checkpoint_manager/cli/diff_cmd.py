"""``ckpt diff A B``: which tensors differ between two checkpoints, and by how much.

Like ``diff``, it exits 1 when anything differs and 0 when the tensors are equal (bit for bit,
unless ``--atol`` allows a tolerance). Tensors are read a group at a time from both sides, so
memory stays near ``--buffer-size`` whatever the model size; train state and metrics that differ
are reported but do not change the exit status (two steps of one run always differ there).
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from checkpoint_manager.cli.errors import CliError, ExitCode
from checkpoint_manager.cli.output import Output
from checkpoint_manager.cli.targets import existing, is_url, resolve_checkpoint
from checkpoint_manager.cli.tensors import TensorInfo, TensorSource, name_filter, open_source

if TYPE_CHECKING:
    import torch

__all__ = ["add_parser", "compare_tensors", "run"]

EPILOG = """\
examples:
  ckpt diff runs/exp1/step_00001000 runs/exp1/step_00002000
  ckpt diff runs/a runs/b --filter 'model.*'       only the model's tensors
  ckpt diff run/step_00000100 export/ --section model   a checkpoint against its safetensors export
  ckpt diff a b --atol 1e-6 --json
A tensor on one side only that the model ties to one both sides hold (lm_head.weight, left out of a
Hugging Face export because from_pretrained ties it to the embedding) is reported as tied, not missing,
when it equals that tensor on the other side. Which tensors are tied comes from config.json (or the
config the checkpoint recorded at save time).
exit status: 0 equal, 1 different (values, shapes, dtypes, or keys missing on one side).
"""

_CHUNK = 1 << 22  # elements compared at a time (bounds the float64 temporaries)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "diff",
        parents=[common],
        help="compare the tensors of two checkpoints (exit 1 if they differ)",
        description="Compare two checkpoints tensor by tensor: keys only in A or only in B, shape and "
        "dtype changes, and for the rest the largest absolute difference and how many elements differ.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", metavar="A", help="checkpoint, save directory (newest), bundle or safetensors")
    p.add_argument("b", metavar="B")
    p.add_argument("--filter", default=None, metavar="PATTERN", help="only tensors whose name matches (glob)")
    p.add_argument("--regex", action="store_true", help="--filter is a regular expression")
    p.add_argument(
        "--section",
        default=None,
        help="compare only this section of DCP checkpoints (e.g. model), named without its prefix; "
        "the default when one side is safetensors",
    )
    p.add_argument("--atol", type=float, default=0.0, help="tensors within this absolute difference are equal")
    p.add_argument("--buffer-size", default="256MiB", help="tensor bytes held per side at a time")
    p.set_defaults(run=run)


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """``(max |a - b|, differing elements)`` of two same-shaped tensors, compared as numbers.

    NaN at the same place on both sides counts as equal; NaN against a number is an infinite
    difference. Works in chunks so a large tensor needs no full float64 copy.
    """
    import torch

    x = a.reshape(-1)
    y = b.reshape(-1)
    if x.numel() == 0 or (a.dtype == b.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))):
        return 0.0, 0  # bit-identical: the common case, and the cheap one
    worst = 0.0
    count = 0
    for start in range(0, x.numel(), _CHUNK):
        xs = x[start : start + _CHUNK]
        ys = y[start : start + _CHUNK]
        if xs.is_complex() or ys.is_complex():
            xs, ys = torch.view_as_real(xs.to(torch.complex128)), torch.view_as_real(ys.to(torch.complex128))
        else:
            xs, ys = xs.to(torch.float64), ys.to(torch.float64)
        both_nan = torch.isnan(xs) & torch.isnan(ys)
        delta = (xs - ys).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
        differs = (xs != ys) & ~both_nan
        count += int(differs.sum()) if differs.dim() == 1 else int(differs.any(dim=-1).sum())
        if delta.numel():
            worst = max(worst, float(delta.max()))
    return worst, count


def _spec(t: TensorInfo) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": t.dtype}


def _is_weights(text: str) -> bool:
    from checkpoint_manager.formats.hf import is_hf_weights

    return not is_url(text) and is_hf_weights(existing(text))


def _open(text: str, section: str | None, args: argparse.Namespace) -> tuple[TensorSource, dict[str, Any]]:
    if _is_weights(text):
        return open_source(existing(text)), {}
    ckpt = resolve_checkpoint(text, args=args)
    return open_source(ckpt.path, section=section), ckpt.meta


def _tied_pairs(source: TensorSource) -> dict[str, str]:
    """``{tied copy: source}`` by the model's config: ``config.json`` of weights, a checkpoint's recorded one."""

    from checkpoint_manager.core.safe_io import read_json
    from checkpoint_manager.errors import CheckpointError
    from checkpoint_manager.formats.hf import tied_pairs
    from checkpoint_manager.formats.model_config import read_recorded_config

    config: Any = None
    try:
        if source.kind == "checkpoint":
            if source.section:
                recorded = read_recorded_config(source.path, source.section)
                config = recorded.config if recorded is not None else None
        elif source.path.is_dir():
            config = read_json(source.path / "config.json", root=source.path)
    except (OSError, ValueError, CheckpointError):  # no usable config: nothing is known to be tied
        return {}
    return tied_pairs(config) if isinstance(config, dict) else {}


def _resolve_tied(
    only: list[str], here: TensorSource, there: TensorSource, there_names: set[str], pairs: dict[str, str],
    atol: float, side: str,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Split tensors found on one side only into (still missing, tied): a tied copy is compared with
    its source on the other side, which is what loading that side gives it."""
    still: list[str] = []
    tied: list[dict[str, Any]] = []
    for name in only:
        source = pairs.get(name)
        if source is None or source not in there_names:
            still.append(name)
            continue
        mine = here.read([name])[name]
        theirs = there.read([source])[source]
        if mine.shape != theirs.shape:
            still.append(name)
            continue
        worst, count = compare_tensors(mine, theirs)
        tied.append({"name": name, "tied_to": source, "only_in": side, "equal": worst <= atol,
                     "max_abs_diff": worst, "differing_elements": count})
    return still, tied


def _state_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    """Train state and metrics that differ (only between two of our checkpoints: weights have none)."""
    out: dict[str, list[Any]] = {}
    if not a or not b:
        return out
    for key in ("train_state", "metrics"):
        da, db = a.get(key) or {}, b.get(key) or {}
        for name in sorted(set(da) | set(db)):
            if da.get(name) != db.get(name):
                out[f"{key}.{name}"] = [da.get(name), db.get(name)]
    return out


def run(args: argparse.Namespace, out: Output) -> int:
    from checkpoint_manager.formats.sizes import parse_size

    if args.atol < 0 or math.isnan(args.atol):
        raise CliError(ExitCode.USAGE, f"--atol {args.atol}: must be a non-negative number")
    buffer = parse_size(args.buffer_size)
    section = args.section
    if section is None and _is_weights(args.a) != _is_weights(args.b):
        section = "model"
    src_a, meta_a = _open(args.a, section, args)
    src_b, meta_b = _open(args.b, section, args)
    match = name_filter(args.filter, regex=args.regex)
    ta = {t.name: t for t in src_a.tensors if match(t.name)}
    tb = {t.name: t for t in src_b.tensors if match(t.name)}
    missing = [n for n in ta if n not in tb]
    extra = [n for n in tb if n not in ta]
    tied: list[dict[str, Any]] = []
    if missing or extra:
        pairs = {**_tied_pairs(src_a), **_tied_pairs(src_b)}
        if pairs:
            missing, tied_a = _resolve_tied(missing, src_a, src_b, set(tb), pairs, args.atol, "A")
            extra, tied_b = _resolve_tied(extra, src_b, src_a, set(ta), pairs, args.atol, "B")
            tied = tied_a + tied_b
    changed = []
    comparable: list[str] = []
    for name, t in ta.items():
        if name not in tb:
            continue
        u = tb[name]
        if t.shape != u.shape or t.dtype != u.dtype:
            changed.append({"name": name, "a": _spec(t), "b": _spec(u)})
        if t.shape == u.shape:
            comparable.append(name)

    different: list[dict[str, Any]] = []
    equal = 0
    groups: list[list[str]] = [[]]
    size = 0
    for name in comparable:
        nbytes = max(ta[name].nbytes, tb[name].nbytes)
        if groups[-1] and size + nbytes > buffer:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    total = sum(ta[name].nbytes + tb[name].nbytes for name in comparable)
    with out.progress("comparing tensors", total, unit="bytes") as advance:
        for group in groups:
            if not group:
                continue
            va = src_a.read(group)
            vb = src_b.read(group)
            for name in group:
                worst, count = compare_tensors(va.pop(name), vb.pop(name))
                if worst <= args.atol:  # a dtype change alone is reported under "changed"
                    equal += 1
                else:
                    numel = math.prod(ta[name].shape)
                    different.append(
                        {"name": name, "max_abs_diff": worst, "differing_elements": count, "numel": numel,
                         "dtype": ta[name].dtype, "shape": list(ta[name].shape)}
                    )
                advance(ta[name].nbytes + tb[name].nbytes)
    is_equal = not (missing or extra or changed or different) and all(t["equal"] for t in tied)
    doc = {
        "a": args.a if is_url(args.a) else str(src_a.path),
        "b": args.b if is_url(args.b) else str(src_b.path),
        "section": section,
        "filter": args.filter,
        "atol": args.atol,
        "equal": is_equal,
        "compared": len(comparable),
        "equal_tensors": equal,
        "different": different,
        "changed": changed,
        "missing": missing,
        "extra": extra,
        "tied": tied,
        "state": _state_diff(meta_a, meta_b),
    }
    if out.json_mode:
        out.emit(doc)
    else:
        _render(doc, out)
    return ExitCode.OK if is_equal else ExitCode.DIFFERENT


def _render(doc: dict[str, Any], out: Output) -> None:
    for name in doc["missing"]:
        out.line(f"- {name}  (only in A)")
    for name in doc["extra"]:
        out.line(f"+ {name}  (only in B)")
    for t in doc["tied"]:
        where = f"only in {t['only_in']}: tied to {t['tied_to']}"
        if t["equal"]:
            out.line(f"= {t['name']}  ({where}, equal)")
        else:
            out.line(f"! {t['name']}  ({where}, which differs: max |a-b| {t['max_abs_diff']:.6g})")
    for c in doc["changed"]:
        a, b = c["a"], c["b"]
        out.line(f"~ {c['name']}  {a['dtype']}{a['shape']} -> {b['dtype']}{b['shape']}")
    if doc["different"]:
        rows = [
            [d["name"], f"{d['max_abs_diff']:.6g}", f"{d['differing_elements']}/{d['numel']}", d["dtype"]]
            for d in doc["different"]
        ]
        out.table(["tensor", "max |a-b|", "elements differing", "dtype"], rows, right=("max |a-b|",))
    for key, (va, vb) in doc["state"].items():
        out.line(f"  {key}: {va} -> {vb}")
    verdict = "equal" if doc["equal"] else "DIFFERENT"
    tol = f" (atol {doc['atol']:g})" if doc["atol"] else ""
    out.line(
        f"{verdict}{tol}: {doc['compared']} tensor(s) compared, {doc['equal_tensors']} equal, "
        f"{len(doc['different'])} differ in value, {len(doc['changed'])} changed shape/dtype, "
        f"{len(doc['missing'])} only in A, {len(doc['extra'])} only in B"
        + (f", {len(doc['tied'])} tied" if doc["tied"] else "")
    )
