"""Turn raw measurements into medians, ratios, floor checks and a markdown table."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

# (op, cache, contender, reference, minimum throughput ratio contender/reference): issue #10's floors
# (and issue #1's ours >= 0.9x dcp.save). ``cache`` None = any (saves).
FLOORS: tuple[tuple[str, str | None, str, str, float], ...] = (
    ("save", None, "ours", "O_DIRECT write+fsync", 0.7),
    ("save", None, "ours", "dcp.save", 0.9),
    ("load", "warm", "ours", "torch.load(mmap)", 0.9),
    ("load", "cold", "ours", "O_DIRECT read", 0.7),
)
# Peak RSS a sync save may add, as a fraction of the state.
RSS_FLOOR = 0.15

GroupKey = tuple[str, str, str | None]  # (case, op, cache)


def _key(rec: dict[str, Any]) -> GroupKey:
    return (str(rec.get("case", f"dense {rec['size_gib']:g} GiB")), rec["op"], rec.get("cache"))


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (case, op, cache, contender): medians over the successful repeats."""
    groups: dict[tuple[GroupKey, str], list[dict[str, Any]]] = defaultdict(list)
    order: list[tuple[GroupKey, str]] = []
    for rec in records:
        key = (_key(rec), rec["name"])
        if key not in groups:
            order.append(key)
        groups[key].append(rec)
    rows = []
    for key in order:
        recs = groups[key]
        ok = [r for r in recs if "error" not in r]
        (case, op, cache), name = key
        row: dict[str, Any] = {
            "case": case,
            "shape": recs[0].get("shape", "dense"),
            "size_gib": recs[0]["size_gib"],
            "op": op,
            "cache": cache,
            "name": name,
            "role": recs[0]["role"],
            "runs": len(ok),
            "failures": len(recs) - len(ok),
            "load_avg_1min": [r.get("load_avg_1min") for r in recs],
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


def _group(rows: list[dict[str, Any]], key: GroupKey) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows if (r["case"], r["op"], r["cache"]) == key and "gbps" in r}


def ratio(rows: list[dict[str, Any]], key: GroupKey, name: str, peer: str) -> float | None:
    """Throughput of ``name`` over that of ``peer`` (= peer's time / name's time) in one group.

    Paired by repeat: repeat r of every contender runs in the same round, minutes apart at most,
    so the median of the per-round quotients cancels slow drift of a shared machine better than
    the quotient of two medians (used only when no round has both).
    """
    by = _group(rows, key)
    if name not in by or peer not in by:
        return None
    mine, theirs = by[name]["seconds_by_repeat"], by[peer]["seconds_by_repeat"]
    rounds = sorted(set(mine) & set(theirs))
    if rounds:
        return float(statistics.median(theirs[r] / mine[r] for r in rounds))
    return float(by[peer]["seconds_median"] / by[name]["seconds_median"])


def best_peer(rows: list[dict[str, Any]], key: GroupKey) -> str | None:
    """The fastest peer (by median) of a group."""
    peers = [r for r in _group(rows, key).values() if r["role"] == "peer"]
    return min(peers, key=lambda r: r["seconds_median"])["name"] if peers else None


def limit_of(rows: list[dict[str, Any]], key: GroupKey) -> str | None:
    limits = [r["name"] for r in _group(rows, key).values() if r["role"] == "limit"]
    return limits[0] if limits else None


def groups(rows: list[dict[str, Any]]) -> list[GroupKey]:
    return list(dict.fromkeys((r["case"], r["op"], r["cache"]) for r in rows))


def floor_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in groups(rows):
        case, op, cache = key
        for f_op, f_cache, name, ref, floor in FLOORS:
            if f_op != op or (f_cache is not None and f_cache != cache):
                continue
            value = ratio(rows, key, name, ref)
            if value is not None:
                out.append({"case": case, "op": op, "cache": cache, "name": name, "peer": ref,
                            "floor": floor, "ratio": value, "passed": value >= floor})
        ours = _group(rows, key).get("ours")
        if op == "save" and ours is not None:
            frac = max(0.0, ours["peak_rss_delta"]) / ours["payload_bytes"]
            out.append({"case": case, "op": op, "cache": cache, "name": "ours", "peer": "peak RSS / state",
                        "floor": RSS_FLOOR, "ratio": frac, "passed": frac <= RSS_FLOOR, "at_most": True})
    return out


def _mib(n: float) -> str:
    return f"{max(n, 0) / 2**20:,.0f} MiB"


def machine_line(machine: dict[str, Any]) -> str:
    return (
        f"Machine: {machine['cores']} cores ({machine['cpu']}), {machine['memory_gib']} GiB RAM, "
        f"{machine['filesystem']}, kernel {machine['kernel']}, torch {machine['torch']}, "
        f"code {machine.get('code', '?')}; 1-min load average at start "
        f"{machine.get('load_average', [float('nan')])[0]:.1f}."
    )


def group_title(key: GroupKey, payload: int) -> str:
    case, op, cache = key
    what = {"save": "sync save", "load": f"load, {cache} page cache", "resume": f"resume to first step, {cache} page cache"}
    return f"{what.get(op, op)}: {case} ({payload / 1e9:.3f} GB of tensors)"


def group_table(rows: list[dict[str, Any]], key: GroupKey) -> list[str]:
    group = [r for r in rows if (r["case"], r["op"], r["cache"]) == key]
    limit, peer = limit_of(rows, key), best_peer(rows, key)
    payload = next((r["payload_bytes"] for r in group if "payload_bytes" in r), 0)
    lines = [f"#### {group_title(key, payload)}", ""]
    head = ["contender", "median s (min-max)", "GB/s", "best GB/s", f"x limit ({limit or '—'})",
            f"x best peer ({peer or '—'})", "x ours", "peak RSS over state"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for r in group:
        if "gbps" not in r:
            lines.append(f"| {r['name']} | failed: {r.get('error', '?')[:80]} |" + " |" * (len(head) - 2))
            continue
        cells = [
            f"**{r['name']}**" if r["role"] == "ours" else r["name"],
            f"{r['seconds_median']:.3f} ({r['seconds_min']:.3f}-{r['seconds_max']:.3f})",
            f"{r['gbps']:.3f}",
            f"{r['payload_bytes'] / r['seconds_min'] / 1e9:.3f}",
        ]
        for ref in (limit, peer, "ours"):
            v = ratio(rows, key, r["name"], ref) if ref else None
            cells.append("—" if ref == r["name"] or v is None else f"{v:.2f}")
        rss = max(0.0, r["peak_rss_delta"])
        cells.append(f"{_mib(rss)} ({100 * rss / max(r['payload_bytes'], 1):.0f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for r in group:
        if r.get("sub_timings") and r["role"] == "ours":
            total = r["seconds_median"]
            parts = ", ".join(f"{k} {v:.3f}s ({100 * v / total:.0f}%)" for k, v in r["sub_timings"].items())
            lines.append(f"{r['name']} breakdown (median; % of the median total): {parts}")
            lines.append("")
    return lines


def floor_lines(checks: list[dict[str, Any]]) -> list[str]:
    lines = []
    for c in checks:
        verdict = "PASS" if c["passed"] else "FAIL"
        rel = "<=" if c.get("at_most") else ">="
        where = f"{c['op']}{', ' + c['cache'] if c['cache'] else ''}, {c['case']}"
        lines.append(f"- {where}: {c['name']} / {c['peer']} = {c['ratio']:.2f} (floor {rel} {c['floor']}) **{verdict}**")
    return lines


def markdown(rows: list[dict[str, Any]], machine: dict[str, Any], repeats: int, cache: str = "") -> str:
    lines = [
        machine_line(machine) + f" Median of {repeats} run(s), each in a fresh process.",
        "GB/s = tensor bytes / median seconds (10**9 B/s); best GB/s uses the fastest run. `x X` = this row's "
        "throughput divided by X's (1.00 = as fast as X), the median of the per-round quotients, each round "
        "running every contender once. Peak RSS over state: high-water RSS during the call minus RSS before it "
        "(file pages mapped by mmap count), and as % of the state.",
        "",
    ]
    for key in groups(rows):
        lines += group_table(rows, key)
    checks = floor_checks(rows)
    if checks:
        lines += ["Floor checks:", "", *floor_lines(checks), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Re-render the tables of a results.json: ``python -m benchmarks.report RESULTS.json``."""
    import json
    from pathlib import Path

    data = json.loads(Path(argv[1]).read_text())
    rows = summarize(data["records"])
    print(markdown(rows, data["machine"], data["args"]["repeats"]))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv))
