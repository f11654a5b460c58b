"""Saves of many ranks without DCP's plan exchange, in real gloo jobs.

Real gloo jobs (FSDP2 and HSDP) save four times (the third adds a tensor): every checkpoint loads
with plain ``dcp.load`` and through the manager at another world size, and a save that reuses the
plan runs exactly the collectives the docs list.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.helpers.process import ROOT, child_env

CHILD = ROOT / "tests" / "helpers" / "multirank_child.py"


# -- real jobs ------------------------------------------------------------------------------------


def _run(out: Path, world: int, args: list[str], timeout: float = 240.0, **extra_env: str) -> None:
    store = out / f"store_{args[0]}_{world}"
    procs = []
    for rank in range(world):
        env = child_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(world), CM_TEST_STORE=str(store), OMP_NUM_THREADS="1", **extra_env)
        log = open(out / f"{args[0]}_{world}_rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(CHILD), args[0], str(out), *args[1:]], env=env,
                                       stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True), log))
    failed = []
    try:
        for rank, (proc, _) in enumerate(procs):
            if proc.wait(timeout=timeout) != 0:
                failed.append(rank)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        text = (out / f"{args[0]}_{world}_rank{failed[0]}.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"{args[0]} job of {world} ranks failed on ranks {failed}:\n{text}", pytrace=False)


def _plain_dcp_load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.full_like(v, 7.0) for k, v in like.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    problems = [f"keys differ: {sorted(set(a) ^ set(b))}"] if a.keys() != b.keys() else []
    return problems + [k for k in sorted(a.keys() & b.keys()) if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("mode", "world"), [("fsdp", 4), ("hsdp", 4)])
def test_saves_of_a_job_load_with_plain_dcp_and_at_half_the_ranks(tmp_path: Path, mode: str, world: int) -> None:
    _run(tmp_path, world, ["save", mode])
    checkpoints = sorted((tmp_path / "ckpt").glob("step_*"))
    assert [p.name for p in checkpoints] == [f"step_{s:08d}" for s in range(1, 5)]
    for step, path in enumerate(checkpoints, start=1):
        saved = load_file(str(tmp_path / f"saved_{step}.safetensors"))
        assert _equal(saved, _plain_dcp_load(path, saved)) == [], step
    _run(tmp_path, world // 2, ["load"])
    loaded = load_file(str(tmp_path / f"loaded_ws{world // 2}.safetensors"))
    assert _equal(load_file(str(tmp_path / "saved_4.safetensors")), loaded) == []
    report = json.loads((tmp_path / f"loaded_ws{world // 2}.json").read_text())
    assert report["step"] == 4
    # the checkpoint to load (a broadcast), then all-reduces of a few integers: the vote that ends the
    # checks (rank 0's of every file among them), the vote between checking the records and copying
    # the first, the vote that ends the read, whether the checkpoint is still there. No plan,
    # metadata or file list travels: each rank reads the chunk index itself
    names = [name for name, _ in report["collectives"]]
    assert names == ["broadcast", "all_reduce", "all_reduce", "all_reduce", "all_reduce"]
    assert max(payload for name, payload in report["collectives"] if name == "all_reduce") <= 16
    # loads read the chunk index, not .metadata: "sizes" checks its size, "full" its CRC-32 too
    from checkpoint_manager.core.integrity import verify

    flipped = checkpoints[-2] / ".metadata"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    flipped.write_bytes(bytes(raw))
    assert verify(checkpoints[-2], "sizes") == []
    assert [p.split(":")[0] for p in verify(checkpoints[-2], "full")] == [str(flipped)]
    # rank 0 alone checks every file of a load; its verdict reaches every rank, before any is read
    data = checkpoints[-1] / "__1_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 1)
    _run(tmp_path, world // 2, ["load_damaged"])
    for rank in range(world // 2):
        outcome = json.loads((tmp_path / f"damaged_rank{rank}.json").read_text())
        assert outcome["error"] == "CheckpointCorruptError", outcome
        assert f"{data}: size " in outcome["message"] and "(truncated or altered)" in outcome["message"]


@pytest.mark.timeout(600)
def test_a_save_that_reuses_the_plan_runs_one_small_all_reduce_and_a_gather_of_votes(tmp_path: Path) -> None:
    """The collectives of each save, on rank 0: the decision and the pending directory (broadcasts),
    the engine's all-reduce of 8 integers, the gather of the chunk reports only when the plan changed
    (the first save and the third, which adds a tensor), the vote (a gather of 1 KiB), the commit's
    outcome (a broadcast). No plan, result or metadata travels otherwise."""
    _run(tmp_path, 4, ["save", "fsdp"])
    counts = json.loads((tmp_path / "counts.json").read_text())
    names = [[name for name, _ in save] for save in counts]
    first, reused, changed, reused_again = names
    assert reused == ["broadcast", "broadcast", "all_reduce", "gather", "broadcast"]
    assert reused_again == reused
    assert first == ["broadcast", "broadcast", "broadcast", "all_reduce", "gather", "gather", "broadcast"]
    assert changed == ["broadcast", "broadcast", "all_reduce", "gather", "gather", "broadcast"]
    payloads = dict(zip(names[1], (p for _, p in counts[1]), strict=True))
    assert payloads["all_reduce"] == 8 * 8 and payloads["gather"] == 1024


@pytest.mark.timeout(600)
def test_ranks_holding_different_tensors_save_through_dcp(tmp_path: Path) -> None:
    """Rank 1 alone holds ``extra.only1``: the ranks' tables differ, so every save goes through
    ``dcp.save`` (its plan exchange), and the checkpoint holds every rank's tensors."""
    _run(tmp_path, 4, ["save", "uneven"])
    counts = json.loads((tmp_path / "counts.json").read_text())
    assert all("gather_object" in [name for name, _ in save] for save in counts)
    for step, path in enumerate(sorted((tmp_path / "ckpt").glob("step_*")), start=1):
        saved = load_file(str(tmp_path / f"saved_{step}.safetensors"))
        saved["extra.only1.shadow"] = torch.arange(6, dtype=torch.float32) * 10
        assert _equal(saved, _plain_dcp_load(path, saved)) == [], step


@pytest.mark.timeout(600)
def test_votes_larger_than_their_slot_are_gathered_again(tmp_path: Path) -> None:
    """With 64-byte vote slots no rank's records fit: rank 0 asks (in the commit's broadcast) for
    slots as large as the largest vote, every rank votes again, and the checkpoint is complete."""
    _run(tmp_path, 2, ["save", "fsdp"], CM_TEST_VOTE_SLOT="64")
    counts = json.loads((tmp_path / "counts.json").read_text())
    reused = [name for name, _ in counts[1]]
    assert reused == ["broadcast", "broadcast", "all_reduce", "gather", "broadcast", "gather", "broadcast"]
    slots = [payload for name, payload in counts[1] if name == "gather"]
    assert slots[0] == 64 and slots[1] > 64
    for step, path in enumerate(sorted((tmp_path / "ckpt").glob("step_*")), start=1):
        saved = load_file(str(tmp_path / f"saved_{step}.safetensors"))
        assert _equal(saved, _plain_dcp_load(path, saved)) == [], step
        meta = json.loads((path / "checkpoint.json").read_text())
        assert {"rank_00000.json", "rank_00001.json", "__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])
