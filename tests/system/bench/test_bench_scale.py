"""The scale benchmark's CI configuration: every coordinator step runs at 64 and 512 ranks (FSDP2 and
HSDP), and none of the figures grows faster than linearly in the rank count.

The fitted exponents are of CPU seconds (the process runs one thread), so a loaded machine shifts
them little; a figure below the benchmark's noise floor at both counts has none. The bound, 1.3, is
well above the exponents measured (0.5-1.0) and well below a quadratic step's.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.helpers.process import ROOT, run_python

if str(ROOT) not in sys.path:  # benchmarks/ is a top-level folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_scale import fit_exponent

HEADLINE = (
    "coordinator_s.reused",
    "coordinator_s.first",
    "coordinator_peak_mib.reused",
    "coordinator_peak_mib.first",
    "discovery_s",
    "verify_s",
    "load_plan_s.same",
    "load_plan_s.half",
    "per_rank_s",
)


@pytest.mark.timeout(240)
def test_quick_scale_run_has_every_figure_and_no_exponent_above_1_3(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    run_python(["-m", "benchmarks.bench_scale", "--ranks", "64,512", "--quick", "--json", str(out)], timeout=200)
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [(r["ranks"], r["sharding"]) for r in rows] == [(64, "fsdp"), (512, "fsdp"), (64, "hsdp"), (512, "hsdp")]
    for row in rows:
        assert row["metadata_bytes"] > 0 and row["index_bytes"] > 0 and row["checkpoint_json_bytes"] > 0
        assert row["coordinator_s"]["first"] > 0 and row["load_plan_s"]["same"] > 0
        # a save that reuses the plan moves 64 bytes each way in the engine and one vote slot up
        assert row["wire_bytes"]["exchange"] == 64 and row["wire_bytes"]["vote_up"] == 1024
    fitted = data["exponents"]
    for sharding in ("fsdp", "hsdp"):
        assert fitted[f"{sharding}:coordinator_s.first"] is not None  # above the noise floor: fitted
    too_steep = {k: v for k, v in fitted.items() if v is not None and v > 1.3}
    assert not too_steep, f"exponents above 1.3: {too_steep}"
    for name in HEADLINE:
        assert f"fsdp:{name}" in fitted and f"hsdp:{name}" in fitted


def test_fit_exponent_is_the_log_log_slope() -> None:
    assert fit_exponent([(64.0, 1.0), (512.0, 8.0)]) == pytest.approx(1.0)
    assert fit_exponent([(64.0, 2.0), (128.0, 8.0), (256.0, 32.0)]) == pytest.approx(2.0)
    assert fit_exponent([(64.0, 3.0), (4096.0, 3.0)]) == pytest.approx(0.0)
    assert fit_exponent([(64.0, 1.0)]) is None and fit_exponent([(64.0, 0.0), (128.0, 1.0)]) is None
    assert math.isclose(fit_exponent([(1.0, 1.0), (10.0, 10 ** 1.1)]) or 0.0, 1.1)
