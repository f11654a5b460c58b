"""Turn raw measurements into medians, ratios, floor checks and a markdown table."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

# (op, contender, peer, minimum throughput ratio contender/peer): the acceptance floors.
FLOORS: tuple[tuple[str, str, str, float], ...] = (("save", "ours", "dcp.save", 0.9),)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, op, contender): medians over the successful repeats."""
    groups: dict[tuple[float, str, str], list[dict[str, Any]]] = defaultdict(list)
    order: list[tuple[float, str, str]] = []
    for rec in records:
        key = (rec["size_gib"], rec["op"], rec["name"])
        if key not in groups:
            order.append(key)
        groups[key].append(rec)
    rows = []
    for key in order:
        recs = groups[key]
        ok = [r for r in recs if "error" not in r]
        row: dict[str, Any] = {
            "size_gib": key[0],
            "op": key[1],
            "name": key[2],
            "role": recs[0]["role"],
            "runs": len(ok),
            "failures": len(recs) - len(ok),
        }
        if ok:
            secs = [r["seconds"] for r in ok]
            payload = ok[0]["payload_bytes"]
            median = statistics.median(secs)
            subs: dict[str, list[float]] = defaultdict(list)
            for r in ok:
                for k, v in r.get("sub_timings", {}).items():
                    subs[k].append(v)
            row.update(
                seconds_median=median,
                seconds_min=min(secs),
                seconds_max=max(secs),
                payload_bytes=payload,
                gbps=payload / median / 1e9,
                disk_bytes=ok[-1].get("disk_bytes", 0),
                peak_rss_delta=statistics.median(r["peak_rss"] - r["rss_before"] for r in ok),
                peak_rss=statistics.median(r["peak_rss"] for r in ok),
                child_maxrss=max(r.get("child_maxrss", 0) for r in ok),
                sub_timings={k: statistics.median(v) for k, v in subs.items()},
                seconds_by_repeat={r["repeat"]: r["seconds"] for r in ok},
            )
        else:
            row["error"] = recs[-1]["error"]
        rows.append(row)
    return rows


def ratio(rows: list[dict[str, Any]], size: float, op: str, name: str, peer: str) -> float | None:
    """Throughput of ``name`` over that of ``peer`` (= peer's time / name's time).

    Paired by repeat: repeat r of every contender runs in the same round, minutes apart at most,
    so the median of the per-round quotients cancels slow drift of a shared machine better than
    the quotient of two medians (used only when no round has both).
    """
    by = {r["name"]: r for r in rows if r["size_gib"] == size and r["op"] == op and "gbps" in r}
    if name not in by or peer not in by:
        return None
    mine, theirs = by[name]["seconds_by_repeat"], by[peer]["seconds_by_repeat"]
    rounds = sorted(set(mine) & set(theirs))
    if rounds:
        return float(statistics.median(theirs[r] / mine[r] for r in rounds))
    return float(by[peer]["seconds_median"] / by[name]["seconds_median"])


def floor_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for size in sorted({r["size_gib"] for r in rows}):
        for op, name, peer, floor in FLOORS:
            value = ratio(rows, size, op, name, peer)
            if value is not None:
                out.append({"size_gib": size, "op": op, "name": name, "peer": peer,
                            "floor": floor, "ratio": value, "passed": value >= floor})
    return out


def _mib(n: float) -> str:
    return f"{max(n, 0) / 2**20:,.0f} MiB"


def markdown(rows: list[dict[str, Any]], machine: dict[str, Any], repeats: int, cache: str) -> str:
    lines = [
        f"Machine: {machine['cores']} cores ({machine['cpu']}), {machine['memory_gib']} GiB RAM, "
        f"{machine['filesystem']}, kernel {machine['kernel']}, torch {machine['torch']}, "
        f"code {machine.get('code', '?')}; 1-min load average at start "
        f"{machine.get('load_average', [float('nan')])[0]:.1f}. "
        f"Median of {repeats} run(s), each in a fresh process; load cache: {cache}.",
        "GB/s = tensor bytes / median seconds (10**9 B/s); best GB/s uses the fastest run. `x X` = this row's throughput divided by X's "
        "(1.00 = as fast as X; against the raw-I/O limit row: how close a contender gets to the disk); "
        "median of the per-round quotients, each round running every contender once.",
        "",
    ]
    for op in dict.fromkeys(r["op"] for r in rows):
        for size in sorted({r["size_gib"] for r in rows if r["op"] == op}):
            group = [r for r in rows if r["op"] == op and r["size_gib"] == size]
            refs = [r["name"] for r in group if r["role"] in ("limit", "peer", "ours")]
            payload = next((r["payload_bytes"] for r in group if "payload_bytes" in r), 0)
            lines.append(f"### {op}, {size:g} GiB target ({payload / 1e9:.3f} GB of tensors)")
            lines.append("")
            head = ["contender", "median s (min-max)", "GB/s", "best GB/s", *[f"x {n}" for n in refs],
                    "bytes on disk", "peak RSS over state"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
            for r in group:
                if "gbps" not in r:
                    lines.append(f"| {r['name']} | failed: {r.get('error', '?')[:60]} |")
                    continue
                cells = [
                    f"**{r['name']}**" if r["role"] == "ours" else r["name"],
                    f"{r['seconds_median']:.3f} ({r['seconds_min']:.3f}-{r['seconds_max']:.3f})",
                    f"{r['gbps']:.3f}",
                    f"{r['payload_bytes'] / r['seconds_min'] / 1e9:.3f}",
                ]
                for peer in refs:
                    v = ratio(rows, size, op, r["name"], peer)
                    cells.append("—" if peer == r["name"] or v is None else f"{v:.2f}")
                cells += [f"{r['disk_bytes'] / 1e9:.3f} GB", _mib(r["peak_rss_delta"])]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
            for r in group:
                if r.get("sub_timings"):
                    total = r["seconds_median"]
                    parts = ", ".join(
                        f"{k} {v:.3f}s ({100 * v / total:.0f}%)" for k, v in r["sub_timings"].items()
                    )
                    lines.append(f"{r['name']} {op} breakdown (median; % of the median total): {parts}")
                    lines.append("")
    checks = floor_checks(rows)
    if checks:
        lines.append("Floor checks:")
        lines.append("")
        for c in checks:
            verdict = "PASS" if c["passed"] else "FAIL"
            lines.append(f"- {c['op']} {c['size_gib']:g} GiB: {c['name']} / {c['peer']} = "
                         f"{c['ratio']:.2f} (floor {c['floor']}) **{verdict}**")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Re-render the tables of a results.json: ``python -m benchmarks.report RESULTS.json``."""
    import json
    from pathlib import Path

    data = json.loads(Path(argv[1]).read_text())
    rows = summarize(data["records"])
    print(markdown(rows, data["machine"], data["args"]["repeats"], data["args"]["cache"]))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv))
