"""The benchmark harness and suite still run end to end (numbers are not asserted: tiny sizes are noise).

The derived figures (floor checks, linear fit, per-byte cost of small tensors) are checked on
hand-made records, where the right answer is known.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.process import ROOT

if str(ROOT) not in sys.path:  # benchmarks/ is a top-level folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks import report, suite


def _rec(case: str, shape: str, size: float, op: str, name: str, role: str, seconds: float,
         payload: int, rep: int = 0, cache: str | None = None, rss: int = 0) -> dict[str, Any]:
    return {"case": case, "shape": shape, "size_gib": size, "op": op, "cache": cache, "name": name,
            "role": role, "repeat": rep, "seconds": seconds, "payload_bytes": payload, "peak_rss": 100 + rss,
            "rss_before": 100, "load_avg_1min": 1.0}


def test_floor_checks_fit_and_small_cost_from_known_records() -> None:
    gb = 10**9
    records = []
    for size, payload in ((1.0, gb), (2.0, 2 * gb)):
        case = f"dense {size:g} GiB"
        # limit: 2 GB/s; ours: 1.6 GB/s + 0.1 s fixed (ratio < 0.8); dcp: 0.4 GB/s
        records += [
            _rec(case, "dense", size, "save", "O_DIRECT write+fsync", "limit", payload / 2e9, payload),
            _rec(case, "dense", size, "save", "ours", "ours", 0.1 + payload / 1.6e9, payload, rss=payload // 10),
            _rec(case, "dense", size, "save", "dcp.save", "peer", payload / 0.4e9, payload),
            _rec(case, "dense", size, "load", "O_DIRECT read", "limit", payload / 2e9, payload, cache="cold"),
            _rec(case, "dense", size, "load", "ours", "ours", payload / 1e9, payload, cache="cold"),
        ]
    small = 80 * 10**6
    records += [
        _rec("20,000 x 4 KiB", "small", 0.07, "save", "ours", "ours", 3 * small / 1.6e9, small),
        _rec("20,000 x 4 KiB", "small", 0.07, "save", "O_DIRECT write+fsync", "limit", small / 2e9, small),
    ]
    rows = report.summarize(records)
    checks = {(c["case"], c["op"], c["peer"]): c for c in report.floor_checks(rows)}
    limit_1 = checks[("dense 1 GiB", "save", "O_DIRECT write+fsync")]
    assert limit_1["ratio"] == pytest.approx((1 / 2) / (0.1 + 1 / 1.6))  # 0.69: just under the floor
    assert limit_1["passed"] is False
    assert checks[("dense 2 GiB", "save", "O_DIRECT write+fsync")]["passed"] is True  # 0.74
    assert checks[("dense 1 GiB", "save", "dcp.save")]["passed"] is True
    assert checks[("dense 1 GiB", "load", "O_DIRECT read")]["ratio"] == pytest.approx(0.5)
    assert checks[("dense 1 GiB", "load", "O_DIRECT read")]["passed"] is False
    rss = checks[("dense 2 GiB", "save", "peak RSS / state")]
    assert rss["ratio"] == pytest.approx(0.1) and rss["passed"] is True
    fits = {(f["op"], f["name"]): f for f in suite.linear_fit(rows)}
    assert fits[("save", "ours")]["fixed_s"] == pytest.approx(0.1)
    assert fits[("save", "ours")]["marginal_gbps"] == pytest.approx(1.6)
    assert fits[("save", "ours")]["r2"] == pytest.approx(1.0)
    cost = {c["name"]: c for c in suite.small_cost(rows)}
    # ours at 2 GB: (0.1 + 2/1.6) s for 2 GB; small: 3/1.6 s per GB
    assert cost["ours"]["ratio"] == pytest.approx((3 / 1.6) / ((0.1 + 2 / 1.6) / 2))
    assert cost["O_DIRECT write+fsync"]["ratio"] == pytest.approx(1.0)


def test_floor_checks_fail_below_the_limit_ratio() -> None:
    gb = 10**9
    rows = report.summarize([
        _rec("dense 1 GiB", "dense", 1.0, "save", "O_DIRECT write+fsync", "limit", 1.0, gb),
        _rec("dense 1 GiB", "dense", 1.0, "save", "ours", "ours", 2.0, gb, rss=gb // 4),
    ])
    checks = {c["peer"]: c for c in report.floor_checks(rows)}
    assert checks["O_DIRECT write+fsync"]["ratio"] == pytest.approx(0.5)
    assert checks["O_DIRECT write+fsync"]["passed"] is False
    assert checks["peak RSS / state"]["passed"] is False


# The smoke runs write little and leave the page cache alone (--no-drop-caches): dropping it would
# make every process on the machine read its libraries from disk again. A hang guard, not a speed bound:
SMOKE_TIMEOUT_S = 800


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_suite_quick_run_writes_results_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite", "--quick", "--sizes", "0.015625", "--small-tensors", "500",
         "--no-drop-caches", "--parts", "core,small",
         "--ops", "save,load", "--contenders", "ours,O_DIRECT write+fsync,format floor",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "suite.json").read_text())
    cases = {(r["case"], r["op"], r["name"]) for r in data["summary"]}
    assert ("dense 0.015625 GiB", "save", "ours") in cases
    assert ("500 x 4 KiB", "load", "ours") in cases
    # the format's floor ran on both sides, and its load was verified tensor by tensor like every load
    assert {("500 x 4 KiB", "save", "format floor"), ("500 x 4 KiB", "load", "format floor")} <= cases
    assert not [r for r in data["records"] if "error" in r]
    assert {c["peer"] for c in data["floors"]} >= {"O_DIRECT write+fsync", "peak RSS / state"}
    assert data["fits"] == []  # one dense size: nothing to fit (the fit is checked above)
    assert {s["name"] for s in data["small_cost"]} >= {"ours", "format floor"}
    assert all("load_avg_1min" in r for r in data["records"])
    text = (out / "suite.md").read_text()
    assert "Floors (issue #10)" in text and "many small tensors" in text
    assert (out / "time_vs_size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
def test_run_quick_cli_still_works(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--sizes", "0.015625", "--no-drop-caches",
         "--only", "save", "--contenders", "ours", "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in results["summary"]] == ["ours"]
    assert results["records"][0]["payload_bytes"] > 0


def test_bench_frozen_runs_its_quick_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_frozen

    assert bench_frozen.main(["--quick", "--dir", str(tmp_path), "--json", str(tmp_path / "out.json")]) == 0
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    # what a later save writes: the trainable state and its optimizer state, not the base
    assert summary["later_bytes"]["once"] < 1.1 * summary["trainable_and_optimizer_bytes"]
    assert summary["later_bytes"]["every"] > summary["base_bytes"]
    assert "first save:  once" in capsys.readouterr().out
