"""Save/load benchmark: ours against raw I/O, torch.save/load and DCP, each run in its own process.

    .venv/bin/python -m benchmarks.run --sizes 0.25,1 --repeats 3 --out bench_results/
    .venv/bin/python -m benchmarks.run --quick            # 64 MiB, 1 repeat: a smoke test

Writes ``results.json`` (machine, every measurement, medians, floor checks) and ``results.md``
(the tables) into ``--out`` and prints the tables. Exit status 1 with ``--fail-under-floor`` when a
floor in report.FLOORS is missed, 2 when a measurement failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report, system
from benchmarks.contenders import CONTENDERS, SAVERS, Contender

REPO = Path(__file__).resolve().parent.parent
QUICK_GIB = 1 / 16


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)


def _spawn(spec: dict[str, Any], scratch: Path, timeout: float) -> dict[str, Any]:
    """Run one worker; return its JSON plus the child's lifetime peak RSS, or an ``error``."""
    spec_file = scratch / "spec.json"
    out_file = scratch / "result.json"
    log_file = scratch / "worker.log"
    out_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**spec, "out": str(out_file)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log_file, "wb") as log:
        import subprocess

        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", str(spec_file)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = -9
                return {"error": f"timed out after {timeout:.0f}s"}
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not out_file.exists():
        tail = log_file.read_text(errors="replace").strip().splitlines()[-15:]
        return {"error": f"exit {proc.returncode}: " + " / ".join(tail)[-800:]}
    result: dict[str, Any] = json.loads(out_file.read_text())
    result["child_maxrss"] = usage.ru_maxrss * 1024
    return result


def _pick(ops: list[str], names: list[str] | None) -> list[Contender]:
    picked = []
    for c in CONTENDERS:
        if c.op not in ops or (names and c.name not in names):
            continue
        reason = c.unavailable()
        if reason:
            print(f"skipping {c.op} {c.name}: {reason}", file=sys.stderr)
            continue
        picked.append(c)
    return picked


def measure_case(
    *,
    size_gib: float,
    size_bytes: int,
    ops: list[str],
    contenders: list[Contender],
    repeats: int,
    scratch: Path,
    timeout: float,
    layers: int = 16,
    shape: str = "dense",
    cache: str = "cold",
    drop_caches: bool = True,
    case: str | None = None,
) -> list[dict[str, Any]]:
    """Measure every op of one state (size and shape) with every contender, ``repeats`` rounds.

    Returns one record per measurement (``case``, ``size_gib``, ``op``, ``name``, ``role``,
    ``repeat``, ``cache``, the load average, and the worker's result or an ``error``).
    """
    records: list[dict[str, Any]] = []
    common = {"size_bytes": size_bytes, "layers": layers, "cache": cache, "drop_caches": drop_caches,
              "shape": shape}
    label = case or f"{shape} {size_gib:g} GiB"
    for op in ops:
        group = [c for c in contenders if c.op == op]
        if not group:
            continue
        fingerprint: dict[str, int] = {}
        fmts = list(dict.fromkeys(c.fmt for c in group)) if op != "save" else []
        if fmts:
            paths = {fmt: str(scratch / f"load-{fmt}") for fmt in fmts}
            res = _spawn({**common, "mode": "prepare", "paths": paths}, scratch, timeout)
            if "error" in res:
                raise RuntimeError(f"preparing the checkpoints to load failed: {res['error']}")
            fingerprint = res["fingerprint"]
        try:
            # Repeats outermost, and each round starts one contender later: slow drift and
            # bursts from neighbours on a shared machine hit every contender alike.
            for rep in range(repeats):
                for c in group[rep % len(group):] + group[:rep % len(group)]:
                    path = scratch / (f"save-{_slug(c.name)}" if op == "save" else f"load-{c.fmt}")
                    spec = {**common, "mode": "measure", "op": op, "name": c.name, "path": str(path)}
                    if op != "save":
                        spec["fingerprint"] = fingerprint
                    load_avg = os.getloadavg()[0]
                    res = _spawn(spec, scratch, timeout)
                    if op == "save":
                        shutil.rmtree(path, ignore_errors=True)
                    rec = {"case": label, "shape": shape, "size_gib": size_gib, "op": op, "name": c.name,
                           "role": c.role, "repeat": rep, "cache": cache if op != "save" else None,
                           "timed": c.timed, "load_avg_1min": load_avg, **res}
                    records.append(rec)
                    tag = f"[{label} {op}{' ' + cache if op != 'save' else ''} {rep + 1}/{repeats}]"
                    if "error" in res:
                        print(f"{tag} {c.name}: FAILED {res['error']}", file=sys.stderr, flush=True)
                    else:
                        print(f"{tag} {c.name}: {res['seconds']:.3f} s, "
                              f"{res['payload_bytes'] / res['seconds'] / 1e9:.3f} GB/s, peak RSS "
                              f"+{max(0, res['peak_rss'] - res['rss_before']) / 2**20:.0f} MiB, "
                              f"load {load_avg:.1f}", file=sys.stderr, flush=True)
        finally:
            for fmt in fmts:
                shutil.rmtree(scratch / f"load-{fmt}", ignore_errors=True)
    return records


def run(args: argparse.Namespace) -> int:
    sizes = [float(s) for s in args.sizes.split(",")]
    ops = args.only.split(",")
    contenders = _pick(ops, args.contenders.split(",") if args.contenders else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cm-bench-", dir=base))
    machine = system.machine(scratch)
    need = max(sizes) * 2**30 * (len(SAVERS) + 1.5)
    if shutil.disk_usage(scratch).free < need:
        print(f"not enough free disk under {scratch}: need {need / 2**30:.1f} GiB", file=sys.stderr)
        return 2
    print(f"scratch: {scratch}  ({machine['filesystem']})", file=sys.stderr)
    records: list[dict[str, Any]] = []
    try:
        for size in sizes:
            records += measure_case(
                size_gib=size, size_bytes=int(size * 2**30), ops=ops, contenders=contenders,
                repeats=args.repeats, scratch=scratch, timeout=args.timeout, layers=args.layers,
                shape=args.shape, cache=args.cache, drop_caches=args.drop_caches,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = report.summarize(records)
    checks = report.floor_checks(rows)
    text = report.markdown(rows, machine, args.repeats, args.cache)
    payload = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": vars(args),
        "machine": machine,
        "contenders": {f"{c.op}:{c.name}": c.timed for c in contenders},
        "summary": rows,
        "floors": checks,
        "records": records,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    (out / "results.md").write_text(text + "\n")
    print(text)
    print(f"results: {out / 'results.json'}, {out / 'results.md'}", file=sys.stderr)
    if any("error" in r for r in records):
        return 2
    if args.fail_under_floor and not all(c["passed"] for c in checks):
        return 1
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help="target state sizes in GiB, comma separated (default 0.25,1)")
    p.add_argument("--repeats", type=int, help="runs per measurement; the median is reported (default 3)")
    p.add_argument("--only", default="save,load", help="operations to run: save,load,resume")
    p.add_argument("--contenders", help="comma-separated contender names (default: all available)")
    p.add_argument("--out", default="bench_results", help="directory for results.json / results.md")
    p.add_argument("--workdir", help="where checkpoints are written (default: the system temp dir)")
    p.add_argument("--layers", type=int, default=16, help="Linear layers (more = smaller tensors)")
    p.add_argument("--shape", choices=("dense", "small", "huge"), default="dense",
                   help="dense: --layers square layers; small: 4 KiB tensors; huge: 2 layers")
    p.add_argument("--cache", choices=("cold", "warm"), default="cold", help="page cache state before a load")
    p.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=True,
                   help="also drop the whole page cache before each measurement (root; falls back "
                   "to evicting just the checkpoint files)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per measurement")
    p.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat: a smoke test of the harness")
    p.add_argument("--fail-under-floor", action="store_true", help="exit 1 when a floor check fails")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = str(QUICK_GIB) if args.quick else "0.25,1"
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
