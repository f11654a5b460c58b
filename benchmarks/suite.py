"""The whole benchmark suite in one command: every case, every peer, the limits, the floors, a plot.

    .venv/bin/python -m benchmarks.suite                                  # 0.25,1,2 GiB, 3 repeats
    .venv/bin/python -m benchmarks.suite --sizes 0.25,1 --parts core,small,huge
    .venv/bin/python -m benchmarks.suite --quick --out /tmp/suite         # smoke: tiny sizes, 1 repeat

Parts (``--parts``, comma separated; default all):

- ``core``: for each size of model + AdamW state (16 square Linear layers): sync save, load from a
  cold and from a warm page cache, and resume to the first training step, against the limits
  (O_DIRECT write+fsync / O_DIRECT read of the same bytes from aligned memory; buffered
  write+fsync, buffered read, memcpy) and the peers (torch.save/load, torch.load(mmap)+copy,
  safetensors, dcp.save/load, torch_checkpointing, the torch_checkpointing plugin when installed);
- ``small``: the many-small-tensors case (``--small-tensors`` tensors of 4 KiB), save and loads;
- ``huge``: the few-huge-tensors case (2 layers: 6 tensors of size/6) at ``--huge-gib``;
- ``async``: ``benchmarks.bench_async`` (stall / total vs memcpy, dcp.async_save thread and process,
  torch_checkpointing first and second save, training-step slowdown);
- ``dist``: ``benchmarks.bench_distributed`` at 1 and 2 ranks (ours vs dcp, save and load);
- ``export``: ``benchmarks.bench_export`` (HF export from a 2-rank checkpoint: time, peak RSS).

Every measurement runs in its own process (``benchmarks.worker``); medians of ``--repeats``; the
1-minute load average is recorded with every measurement. Writes ``suite.json`` (everything, raw),
``suite.md`` (tables, floor checks, linear fit, per-byte cost of small tensors) and
``time_vs_size.png`` into ``--out`` (``--plot`` copies the PNG elsewhere, e.g. into docs/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report, system
from benchmarks.contenders import Contender
from benchmarks.run import _pick, measure_case
from benchmarks.state import SMALL_TENSOR_BYTES

REPO = Path(__file__).resolve().parent.parent
PARTS = ("core", "small", "huge", "async", "dist", "export")
GIB = 2**30
# Sizes above --all-peers-up-to run only these peers (with the limits and ours): the best ones.
BIG_PEERS = ("torch.load(mmap)", "dcp.save", "dcp.load", "torch_checkpointing")
# The many-small-tensors case leaves out the peers that take minutes there (dcp.load: ~60 s, torch.load
# and torch.load(mmap) + set_state_dict: ~30 s for 80 MB on the reference machine), unless --contenders.
SMALL_DEFAULT = ("O_DIRECT write+fsync", "O_DIRECT read", "buffered write+fsync", "buffered read", "memcpy",
                 "torch.save", "safetensors", "dcp.save", "torch_checkpointing", "ours+tc plugin",
                 "format floor", "ours")


def _contenders(args: argparse.Namespace, ops: list[str], size: float, shape: str) -> list[Contender]:
    names = args.contenders.split(",") if args.contenders else None
    if shape == "small" and not names:
        names = list(SMALL_DEFAULT)
    picked = _pick(ops, names)
    if size > args.all_peers_up_to:
        # the format's floor too: the small case's per-byte cost is read against the largest dense one
        picked = [c for c in picked if c.role in ("limit", "ours") or c.name in BIG_PEERS or c.fmt == "floor"]
    return picked


def _sub(cmd: list[str], timeout: float, log: Path) -> tuple[int, str]:
    """Run a benchmark script; return its exit status and the tail of its output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    try:
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = -9
    tail = log.read_text(errors="replace").strip().splitlines()[-20:]
    return rc, "\n".join(tail)


# --- derived figures ---------------------------------------------------------------------------


def linear_fit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Least-squares ``seconds = fixed + per_gb * GB`` over the dense sizes, per (op, cache, contender)."""
    series: dict[tuple[str, str | None, str], list[tuple[float, float]]] = {}
    for r in rows:
        if r["shape"] == "dense" and "gbps" in r:
            series.setdefault((r["op"], r["cache"], r["name"]), []).append(
                (r["payload_bytes"] / 1e9, r["seconds_median"])
            )
    out = []
    for (op, cache, name), pts in series.items():
        if len({x for x, _ in pts}) < 2:
            continue
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        fixed = my - slope * mx
        ss_tot = sum((y - my) ** 2 for _, y in pts)
        ss_res = sum((y - fixed - slope * x) ** 2 for x, y in pts)
        out.append({"op": op, "cache": cache, "name": name, "points": n, "fixed_s": fixed,
                    "s_per_gb": slope, "marginal_gbps": 1 / slope if slope > 0 else None,
                    "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0})
    return out


def small_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-byte cost of the many-small-tensors case over that of the largest dense case."""
    dense = [r for r in rows if r["shape"] == "dense" and "gbps" in r]
    if not dense:
        return []
    largest = max(r["size_gib"] for r in dense)
    out = []
    for r in rows:
        if r["shape"] != "small" or "gbps" not in r:
            continue
        ref = next((d for d in dense if d["size_gib"] == largest and (d["op"], d["cache"], d["name"])
                    == (r["op"], r["cache"], r["name"])), None)
        if ref is None:
            continue
        per_byte = r["seconds_median"] / r["payload_bytes"]
        ref_per_byte = ref["seconds_median"] / ref["payload_bytes"]
        out.append({"op": r["op"], "cache": r["cache"], "name": r["name"], "role": r["role"],
                    "small_gbps": r["gbps"], "large_gbps": ref["gbps"], "large_case": ref["case"],
                    "ratio": per_byte / ref_per_byte})
    return out


def plot(rows: list[dict[str, Any]], fits: list[dict[str, Any]], path: Path) -> bool:
    """Time against size for save, cold load and warm load: ours, the limit and the peers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot", file=sys.stderr)
        return False
    panels = [("save", None, "sync save"), ("load", "cold", "load, cold page cache"),
              ("load", "warm", "load, warm page cache")]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 5))
    for ax, (op, cache, title) in zip(axes, panels, strict=True):
        names = list(dict.fromkeys(r["name"] for r in rows if r["shape"] == "dense" and r["op"] == op
                                   and r["cache"] == cache and "gbps" in r))
        for name in names:
            pts = sorted((r["payload_bytes"] / 1e9, r["seconds_median"], r["role"]) for r in rows
                         if r["shape"] == "dense" and r["op"] == op and r["cache"] == cache
                         and r["name"] == name and "gbps" in r)
            if not pts:
                continue
            role = pts[0][2]
            style = {"ours": dict(lw=3, color="black", marker="o"),
                     "limit": dict(lw=2, color="tab:red", ls="--", marker="s")}.get(role, dict(lw=1, marker="."))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)  # type: ignore[arg-type]
        ax.set_title(title)
        ax.set_xlabel("state size (GB of tensors)")
        ax.set_ylabel("seconds (median)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("checkpoint-manager vs limits and peers: time against size (lower is better)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# --- the report --------------------------------------------------------------------------------


def render(data: dict[str, Any]) -> str:
    rows = data["summary"]
    lines = [report.machine_line(data["machine"]),
             f"Command: `{data['command']}`. Median of {data['args']['repeats']} run(s) per measurement, each in "
             f"a fresh process; 1-min load average during the run: {data['load_range'][0]:.1f}-"
             f"{data['load_range'][1]:.1f}; wall time {data['wall_s'] / 60:.0f} min.", ""]
    checks = data["floors"]
    if checks:
        lines += ["### Floors (issue #10)", "", *report.floor_lines(checks), ""]
    for s in data.get("small_cost", []):
        if s["role"] == "ours":
            lines.append(f"- many small tensors, {s['op']}{', ' + s['cache'] if s['cache'] else ''}: per-byte cost "
                         f"{s['ratio']:.2f}x that of {s['large_case']} (floor <= 2) "
                         f"**{'PASS' if s['ratio'] <= 2 else 'FAIL'}**")
    for a in data.get("async_floors", []):
        lines.append(f"- {a['text']} **{'PASS' if a['passed'] else 'FAIL'}**")
    lines.append("")
    if data.get("fits"):
        lines += ["### Linear fit over the dense sizes (seconds = fixed + GB / marginal GB/s)", "",
                  "| op | contender | points | fixed s | marginal GB/s | R² |", "|---|---|---:|---:|---:|---:|"]
        for f in data["fits"]:
            if f["name"] in ("memcpy",):
                continue
            op = f["op"] + (f" ({f['cache']})" if f["cache"] else "")
            gbps = f"{f['marginal_gbps']:.3f}" if f["marginal_gbps"] else "—"
            lines.append(f"| {op} | {f['name']} | {f['points']} | {f['fixed_s']:.3f} | {gbps} | {f['r2']:.3f} |")
        lines.append("")
    if data.get("small_cost"):
        lines += ["### Many small tensors: per-byte cost over the largest dense case", "",
                  "| op | contender | small GB/s | large GB/s | per-byte cost ratio |", "|---|---|---:|---:|---:|"]
        for s in data["small_cost"]:
            op = s["op"] + (f" ({s['cache']})" if s["cache"] else "")
            name = f"**{s['name']}**" if s["role"] == "ours" else s["name"]
            lines.append(f"| {op} | {name} | {s['small_gbps']:.3f} | {s['large_gbps']:.3f} | {s['ratio']:.2f} |")
        lines.append("")
    for key in report.groups(rows):
        lines += report.group_table(rows, key)
    if data.get("async"):
        from benchmarks.bench_async import table

        lines += ["### Async saves (benchmarks.bench_async)", ""]
        for summary in data["async"].get("sizes", []):
            lines += [table(summary), ""]
    if data.get("dist"):
        lines += ["### 1 and 2 ranks (benchmarks.bench_distributed: ours vs dcp, same total state)", "",
                  "| ranks | op | ours GB/s | dcp GB/s | ours/dcp (medians) | best/best |", "|---:|---|---:|---:|---:|---:|"]
        for ws, res in data["dist"].get("results", {}).items():
            for op, r in res["summary"].items():
                lines.append(f"| {ws} | {op} | {r['ours_gbps']:.3f} | {r['dcp_gbps']:.3f} | {r['ratio']:.2f} | "
                             f"{r['best_ratio']:.2f} |")
        lines.append("")
    if data.get("export"):
        lines += ["### HF export (benchmarks.bench_export: from a 2-rank checkpoint)", "",
                  "| method | seconds | GiB/s | extra RSS MiB | files |", "|---|---:|---:|---:|---:|"]
        for r in data["export"].get("results", []):
            lines.append(f"| {r['method']} | {r['seconds']} | {r['gib_per_s']} | {r['peak_extra_rss_mib']} | {r['files']} |")
        lines.append("")
    for part, err in data.get("part_errors", {}).items():
        lines.append(f"Part {part} failed: {err[-500:]}")
    return "\n".join(lines)


def async_floors(async_data: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue #10's async floors: stall <= 1.2x a warm memcpy; async total <= 1.1x our sync save.

    Each of our saves is divided by the memcpy and the sync save run just before it in the same
    process (``bench_async.w_ours``), the median of those quotients over the repeats.
    """
    from benchmarks.bench_async import OUR_ROWS

    out = []
    for s in async_data.get("sizes", []):
        rows = s["rows"]
        for label, _ in OUR_ROWS:
            r = rows.get(f"ours async, {label}", {})
            for metric, floor, what in (
                ("stall/memcpy paired", 1.2, "warm memcpy"),
                ("total/sync paired", 1.1, "our sync save"),
            ):
                v = r.get(metric)
                if v is not None:
                    name = "stall" if metric.startswith("stall") else "total"
                    out.append({"size_gib": s["size_gib"], "passed": v <= floor, "ratio": v,
                                "text": f"async {name}, {label} save, {s['size_gib']:g} GiB: {v:.2f}x {what} "
                                        f"(paired; floor <= {floor})"})
    return out


# --- driver ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    parts = [p for p in args.parts.split(",") if p and p != "none"]
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        print(f"unknown parts {bad}; choose from {PARTS}", file=sys.stderr)
        return 2
    sizes = [float(s) for s in args.sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.workdir) if args.workdir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cm-suite-", dir=base))
    machine = system.machine(scratch)
    print(f"scratch: {scratch}  ({machine['filesystem']}), parts {parts}", file=sys.stderr)
    records: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for earlier in args.include or []:  # merge runs made separately (e.g. one size at a time)
        prior = json.loads(Path(earlier).read_text())
        records += prior.get("records", [])
        extra.update({k: prior[k] for k in ("async", "dist", "export") if k in prior})

    wanted = [op.strip() for op in args.ops.split(",")]

    def case(size: float, size_bytes: int, shape: str, label: str, ops: list[str]) -> None:
        ops = [op for op in ops if op in wanted]
        common = dict(size_gib=size, size_bytes=size_bytes, repeats=args.repeats, scratch=scratch,
                      timeout=args.timeout, shape=shape, case=label, drop_caches=args.drop_caches)
        cold_ops = [op for op in ops if op != "load warm"]
        records.extend(measure_case(ops=cold_ops, contenders=_contenders(args, cold_ops, size, shape), cache="cold",
                                    **common))  # type: ignore[arg-type]
        if "load warm" in ops:
            records.extend(measure_case(ops=["load"], contenders=_contenders(args, ["load"], size, shape), cache="warm",
                                        **common))  # type: ignore[arg-type]

    def write() -> tuple[dict[str, Any], str]:
        """(Re)write suite.json / suite.md / the PNG from what has been measured so far."""
        rows = report.summarize(records)
        loads = [r["load_avg_1min"] for r in records if r.get("load_avg_1min") is not None] or [os.getloadavg()[0]]
        data: dict[str, Any] = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m benchmarks.suite", *sys.argv[1:]]) if args.argv is None
            else " ".join(["python -m benchmarks.suite", *args.argv]),
            "args": {k: v for k, v in vars(args).items() if k != "argv"},
            "machine": machine,
            "load_range": [min(loads), max(loads)],
            "load_median": statistics.median(loads),
            "wall_s": time.monotonic() - t_start,
            "summary": rows,
            "floors": report.floor_checks(rows),
            "fits": linear_fit(rows),
            "small_cost": small_cost(rows),
            "part_errors": errors,
            **extra,
            "records": records,
        }
        if "async" in extra:
            data["async_floors"] = async_floors(extra["async"])
        png = out / "time_vs_size.png"
        if plot(rows, data["fits"], png) and args.plot and Path(args.plot).resolve() != png.resolve():
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, args.plot)
        text = render(data)
        (out / "suite.json").write_text(json.dumps(data, indent=1, default=str))
        (out / "suite.md").write_text(text + "\n")
        return data, text

    py = sys.executable

    def core() -> None:
        for size in sizes:
            case(size, int(size * GIB), "dense", f"dense {size:g} GiB", ["save", "load", "load warm", "resume"])
            write()

    def small() -> None:
        nbytes = args.small_tensors * SMALL_TENSOR_BYTES
        case(nbytes / GIB, nbytes, "small", f"{args.small_tensors:,} x 4 KiB", ["save", "load", "load warm"])

    def huge() -> None:
        case(args.huge_gib, int(args.huge_gib * GIB), "huge", f"huge {args.huge_gib:g} GiB (6 tensors)",
             ["save", "load"])

    def run_async() -> None:
        path = out / "async.json"
        rc, tail = _sub([py, "-m", "benchmarks.bench_async", "--sizes", args.async_sizes or args.sizes,
                         "--repeats", str(args.repeats), "--only", args.async_only, "--out", str(path),
                         "--workdir", str(scratch / "async")], args.timeout * 20, out / "async.log")
        if rc == 0 and path.exists():
            extra["async"] = json.loads(path.read_text())
        else:
            errors["async"] = f"exit {rc}: {tail}"

    def dist() -> None:
        path = out / "distributed.json"
        rc, tail = _sub([py, "-m", "benchmarks.bench_distributed", "--size-mib", str(args.dist_mib),
                         "--world-sizes", "1,2", "--repeats", str(args.repeats), "--out", str(path),
                         "--workdir", str(scratch / "dist")], args.timeout * 10, out / "distributed.log")
        if rc == 0 and path.exists():
            extra["dist"] = json.loads(path.read_text())
        else:
            errors["dist"] = f"exit {rc}: {tail}"

    def export() -> None:
        path = out / "export.json"
        rc, tail = _sub([py, "-m", "benchmarks.bench_export", "--size-gib", str(args.export_gib), "--ranks", "2",
                         "--json", str(path), "--workdir", str(scratch / "export"), *args.export_args],
                        args.timeout * 10, out / "export.log")
        if path.exists():
            extra["export"] = json.loads(path.read_text())
        if rc != 0:
            errors["export"] = f"exit {rc}: {tail}"

    steps = {"core": core, "small": small, "huge": huge, "async": run_async, "dist": dist, "export": export}
    try:
        for part in parts:  # in the order given
            steps[part]()
            write()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data, text = write()
    print(text)
    print(f"results: {out / 'suite.json'}, {out / 'suite.md'}, {out / 'time_vs_size.png'}", file=sys.stderr)
    if errors or any("error" in r for r in records):
        return 2
    if args.fail_under_floor and not all(c["passed"] for c in data["floors"]):
        return 1
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help="dense state sizes in GiB (default 0.25,1,2; --quick: 0.0625)")
    p.add_argument("--repeats", type=int, help="runs per measurement, the median is reported (default 3)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma separated, run in the order given, of {','.join(PARTS)}")
    p.add_argument("--ops", default="save,load,load warm,resume",
                   help="measurements per case: save, load (cold page cache), load warm, resume")
    p.add_argument("--contenders", help="only these contender names (limits/peers/ours), comma separated")
    p.add_argument("--all-peers-up-to", type=float, default=float("inf"),
                   help="sizes above this (GiB) run only the limits, ours and these peers: " + ", ".join(BIG_PEERS))
    p.add_argument("--small-tensors", type=int, help="tensors in the many-small case (default 20000)")
    p.add_argument("--huge-gib", type=float, help="size of the few-huge-tensors case (default 1)")
    p.add_argument("--async-sizes", help="sizes for the async part (default: --sizes)")
    p.add_argument("--async-only", default="memcpy,ours,dcp-thread,dcp-process,tc,train",
                   help="bench_async contenders")
    p.add_argument("--dist-mib", type=float, help="total state of the 1/2-rank part (default 1024)")
    p.add_argument("--export-gib", type=float, help="model size of the export part (default 1)")
    p.add_argument("--out", default="bench_results/suite", help="directory for suite.json / suite.md / PNG")
    p.add_argument("--include", action="append",
                   help="also report the records of an earlier suite.json (repeatable; --parts none: only merge)")
    p.add_argument("--plot", help="also copy the PNG here (e.g. docs/benchmarks-time-vs-size.png)")
    p.add_argument("--workdir", help="where checkpoints are written (default: the system temp dir)")
    p.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per measurement")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat: a smoke test of the suite")
    p.add_argument("--fail-under-floor", action="store_true", help="exit 1 when a floor check fails")
    args = p.parse_args(argv)
    args.argv = argv
    q = args.quick
    args.sizes = args.sizes or ("0.03125,0.0625" if q else "0.25,1,2")
    args.repeats = args.repeats or (1 if q else 3)
    args.small_tensors = args.small_tensors or (2000 if q else 20000)
    args.huge_gib = args.huge_gib or (0.0625 if q else 1.0)
    args.dist_mib = args.dist_mib or (32.0 if q else 1024.0)
    args.export_gib = args.export_gib or (0.25 if q else 1.0)
    args.export_args = ["--methods", "ours_sharded", "--max-shard-size", "64MiB"] if q else []
    if q and args.async_only == p.get_default("async_only"):
        args.async_only = "memcpy,ours"
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
