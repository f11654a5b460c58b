"""The benchmark harness still runs end to end (numbers are not asserted: 64 MiB is too noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_quick_run_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--contenders", "dcp.save,dcp.load,ours",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results and (out / "results.md").read_text().strip()
    text = json.dumps(results)
    assert "ours" in text and "dcp.save" in text
