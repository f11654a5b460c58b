"""Progress of long ``ckpt`` commands: bytes done of a total, the rate and an ETA, with or without rich.

The commands run as real child processes whose stderr is a real terminal (a pty), as a person sees them.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
from checkpoint_manager.cli.output import human_bytes, io_meter, progress_text
from checkpoint_manager.cli.targets import tree_size
from tests.helpers.process import ROOT


def test_progress_text() -> None:
    mib = 1 << 20
    assert progress_text("packing x", 0, 40 * mib, 0.0, "bytes") == "packing x  0 B / 40.0 MiB  0%  0 B/s  ETA -:--"
    assert progress_text("packing x", 10 * mib, 40 * mib, 2.0, "bytes") == (
        "packing x  10.0 MiB / 40.0 MiB  25%  5.0 MiB/s  ETA 0:06"
    )
    assert progress_text("packing x", 40 * mib, 40 * mib, 8.0, "bytes", finished=True) == (
        "packing x  40.0 MiB / 40.0 MiB  100%  5.0 MiB/s  done in 0:08"
    )
    assert progress_text("packing x", 41 * mib, 40 * mib, 8.0, "bytes") == (  # past an estimated total
        "packing x  40.0 MiB / 40.0 MiB  100%  5.0 MiB/s  ETA 0:00"
    )
    assert progress_text("verifying", 2, None, 3.0, finished=True) == "verifying  2  done in 0:03"
    # no counter on this system (no /proc/self/io): the time alone
    assert progress_text("packing x", 0, None, 7.0) == "packing x  0:07 elapsed"
    assert progress_text("packing x", 0, None, 9.0, finished=True) == "packing x  done in 0:09"
    assert progress_text("unpacking b.tar.gz", 3 * mib, None, 65.0, "bytes") == (
        "unpacking b.tar.gz  3.0 MiB  47.3 KiB/s  1:05 elapsed"
    )
    assert progress_text("verifying", 3, 12, 6.0) == "verifying  3/12  25%  ETA 0:18"
    assert progress_text("verifying", 1, 2, 4000.0) == "verifying  1/2  50%  ETA 1:06:40"


def test_io_meter_counts_this_process_bytes(tmp_path: Path) -> None:
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io here")
    wrote = io_meter("write")
    read = io_meter("read")
    assert wrote is not None and read is not None
    (tmp_path / "f").write_bytes(b"x" * (3 << 20))
    assert (3 << 20) <= wrote() < (3 << 20) + (1 << 20)
    (tmp_path / "f").read_bytes()
    assert (3 << 20) <= read() < (3 << 20) + (1 << 20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("progress") / "run"
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), fsync=False)) as mgr:
        result = mgr.save(SaveContext(model=model, optimizer=opt, train_state=TrainState(step=40), force=True))
    assert result is not None
    return Path(result.path)


def on_terminal(args: list[str], *, plain: bool, cwd: Path) -> tuple[int, str, str]:
    """``python -m checkpoint_manager ARGS`` with stderr on a pty; returns (code, stdout, terminal text)."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["CKPT_PLAIN"] = "1" if plain else "0"
    proc = subprocess.Popen([sys.executable, "-m", "checkpoint_manager", *args], stdout=subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    os.close(slave)
    seen = bytearray()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    stdout, _ = proc.communicate(timeout=60)
    return proc.returncode, stdout.decode(), seen.decode("utf-8", "replace")


def _lines(terminal: str) -> list[str]:
    """What was drawn, one entry per redraw (\\r-separated), trailing blanks dropped."""
    return [part.rstrip() for part in re.split(r"[\r\n]", terminal) if part.strip()]


@pytest.mark.timeout(300)
def test_pack_plain_shows_bytes_of_a_total_and_finishes(checkpoint: Path, tmp_path: Path) -> None:
    code, stdout, terminal = on_terminal(["pack", str(checkpoint), str(tmp_path / "b.tar")], plain=True, cwd=tmp_path)
    assert code == 0, terminal
    total = human_bytes(tree_size(checkpoint))
    drawn = _lines(terminal)
    assert drawn[0].startswith(f"packing {checkpoint.name}  ") and f" / {total}  " in drawn[0], drawn
    assert re.fullmatch(rf"packing {checkpoint.name}  0 B / {re.escape(total)}  0%  .*", drawn[0]), drawn[0]
    assert re.fullmatch(
        rf"packing {checkpoint.name}  {re.escape(total)} / {re.escape(total)}  100%  \S+ \S+/s  done in \d+:\d\d",
        drawn[-1],
    ), drawn
    assert terminal.endswith("\r"), "the progress line is erased at the end"
    assert stdout.startswith(f"wrote {tmp_path / 'b.tar'} (step 40, ")  # stdout holds only the result


@pytest.mark.timeout(300)
def test_export_plain_total_is_the_exported_weights(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "w.safetensors"
    code, _stdout, terminal = on_terminal(["export", str(checkpoint), "--to", "safetensors", "--out", str(out),
                                          "--dtype", "bfloat16"], plain=True, cwd=tmp_path)
    assert code == 0, terminal
    weights = (512 * 512 + 512 + 512 * 256 + 256) * 2  # bfloat16: what the file holds besides its header
    drawn = _lines(terminal)
    assert drawn[0].startswith(f"exporting {checkpoint.name} (safetensors)  0 B / {human_bytes(weights)}  0%")
    assert f"{human_bytes(weights)} / {human_bytes(weights)}  100%" in drawn[-1], drawn
    assert out.stat().st_size > weights


@pytest.mark.timeout(300)
def test_unpack_and_verify_full_show_totals(checkpoint: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "b.tar"
    assert on_terminal(["pack", str(checkpoint), str(bundle)], plain=True, cwd=tmp_path)[0] == 0
    code, _, terminal = on_terminal(["unpack", str(bundle), str(tmp_path / "u")], plain=True, cwd=tmp_path)
    assert code == 0, terminal
    drawn = _lines(terminal)
    assert drawn[0].startswith("unpacking b.tar  0 B / ") and "ETA" in drawn[0], drawn
    code, _, terminal = on_terminal(["verify", "--full", str(checkpoint)], plain=True, cwd=tmp_path)
    assert code == 0, terminal
    drawn = _lines(terminal)
    assert drawn[0].startswith(f"verifying (full)  0 B / {human_bytes(tree_size(checkpoint))}  0%"), drawn


@pytest.mark.timeout(300)
def test_pack_with_rich_shows_a_total_and_an_eta(checkpoint: Path, tmp_path: Path) -> None:
    import rich  # noqa: F401  # the [cli] extra, which scripts/venv.sh installs: a missing rich fails, never skips
    code, _, terminal = on_terminal(["pack", str(checkpoint), str(tmp_path / "b.tar")], plain=False, cwd=tmp_path)
    assert code == 0, terminal
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal)  # drop the terminal control sequences
    assert f"packing {checkpoint.name}" in text
    assert "ETA" in text and "/" in text and "0/?" not in text, text
