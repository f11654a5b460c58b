"""Peer-replicated local checkpoints, for real: two torchrun agents on loopback as two nodes.

Each node has its own local disk (a directory bound, in the node's own mount namespace, at the one
``local_dir`` path both use); the durable tier is shared. A node is killed with SIGKILL mid-training,
its disk wiped, and the job restarted: it must resume from the newest local step, pulling the lost
shares from the peer, bit for bit as a run that never stopped, without the durable tier.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cm_tiered.replicas import file_crc
from replica_nodes import Job, can_isolate_nodes
from safetensors.torch import load_file

from checkpoint_manager import create_checkpoint_manager
from tests.helpers.machine import missing_capability

STEPS = 10
JOB_TIMEOUT = 400  # seconds: four processes importing torch on a busy 2-core machine take a while

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module", autouse=True)
def isolated_nodes() -> None:
    """Skipped without root and unshare (a mount namespace per node); a failure under CI, which has them."""
    if not can_isolate_nodes():
        missing_capability("needs root and unshare (a mount namespace per node)")


def outputs(out: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {r: load_file(str(out / f"rank_{r}.safetensors")) for r in range(4)}


def assert_bit_exact(actual: Path, expected: Path) -> None:
    got, want = outputs(actual), outputs(expected)
    for rank in range(4):
        assert got[rank].keys() == want[rank].keys()
        for key, tensor in want[rank].items():
            assert torch.equal(got[rank][key], tensor), (rank, key)


def result(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "result.json").read_text())
    return data


def logs(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(out.glob("node*.log")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run that never stopped."""
    root = tmp_path_factory.mktemp("reference")
    job = Job(root / "run", root / "out", STEPS)
    job.start()
    job.wait(JOB_TIMEOUT)
    assert result(root / "out")["resumed"]["step"] is None
    return root / "out"


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose node 1 was SIGKILLed mid-training (then node 0 too: the scheduler restarts the job)."""
    root = tmp_path_factory.mktemp("killed")
    # async saves here (the reference saves synchronously): the replication of a background save, too
    job = Job(root / "run", root / "out", STEPS, extra=("--signal-at", "7", "--step-sleep", "0.5", "--async"))
    job.start()
    job.wait_for(root / "out" / "reached", JOB_TIMEOUT)
    job.kill(1)  # node 1 dies with its processes
    time.sleep(1.0)
    job.kill(0)
    return root / "run"


def restart(tmp_path: Path, killed: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(killed, run, symlinks=True)
    for name in ("node0", "node1"):  # nothing of the killed job's processes may survive in them
        assert (run / name).is_dir()
    return run, tmp_path / "out"


def newest_replicated(node_dir: Path) -> int:
    steps = []
    for marker in (node_dir / ".replicas").glob("*/committed.json"):
        steps.append(json.loads(marker.read_text())["step"])
    return max(steps, default=-1)


def test_lost_node_resumes_from_peers_bit_exact(tmp_path: Path, reference: Path, killed: Path) -> None:
    run, out = restart(tmp_path, killed)
    newest = newest_replicated(run / "node0")
    shutil.rmtree(run / "node1")  # the node is replaced: an empty local disk
    (run / "node1").mkdir()
    durable_steps = sorted(int(p.name[5:]) for p in (run / "durable").glob("step_*"))
    assert durable_steps and max(durable_steps) < newest
    hidden = run.parent / "durable-away"
    (run / "durable").rename(hidden)  # the durable tier cannot be read during the resume
    job = Job(run, out, STEPS)
    job.start()
    job.wait(JOB_TIMEOUT)
    resumed = result(out)["resumed"]
    assert resumed == {"step": newest, "path": str(run / "local" / f"step_{newest:08d}")}
    text = logs(out)
    assert "pulled rank 2's share" in text and "pulled rank 3's share" in text
    assert "resumed from the local tiers" in text
    assert_bit_exact(out, reference)
    # the replaced node holds its shares again (and its peer's), under the same retention
    assert newest_replicated(run / "node1") == STEPS


def test_both_copies_lost_falls_back_to_durable(tmp_path: Path, reference: Path, killed: Path) -> None:
    run, out = restart(tmp_path, killed)
    shutil.rmtree(run / "node1")
    (run / "node1").mkdir()
    for share in (run / "node0" / ".replicas").glob("*/rank_0000[23]"):
        shutil.rmtree(share)  # node 0's replicas of node 1's ranks are lost too
    durable = max(int(p.name[5:]) for p in (run / "durable").glob("step_*"))
    job = Job(run, out, STEPS)
    job.start()
    job.wait(JOB_TIMEOUT)
    assert result(out)["resumed"] == {"step": durable, "path": str(run / "durable" / f"step_{durable:08d}")}
    text = logs(out)
    assert "no surviving intact copy of the share of rank(s) 2, 3" in text
    assert "falling back to the durable tier" in text
    assert_bit_exact(out, reference)


def test_corrupted_copy_uses_the_next_one(tmp_path: Path, reference: Path, killed: Path) -> None:
    run, out = restart(tmp_path, killed)
    newest = max(newest_replicated(run / "node0"), newest_replicated(run / "node1"))
    name = f"step_{newest:08d}"
    data = sorted((run / "node1" / ".replicas" / name / "rank_00002").glob("*.distcp"))
    assert data, "rank 2 wrote no data file"
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte: only the CRC32 sees it
    data[0].write_bytes(bytes(raw))
    job = Job(run, out, STEPS)
    job.start()
    job.wait(JOB_TIMEOUT)
    assert result(out)["resumed"]["step"] == newest
    text = logs(out)
    assert f"the copy of rank 2's share of local step {newest} on node 1 is damaged" in text
    assert "pulled rank 2's share" in text  # from node 0's replica
    assert_bit_exact(out, reference)


def test_replicas_need_enough_nodes(tmp_path: Path) -> None:
    fields = {
        "manager": "tiered",
        "save_dir": str(tmp_path / "durable"),
        "local_dir": str(tmp_path / "local"),
        "replicas": 1,
    }
    with pytest.raises(ValueError, match=r"replicas=1 needs at least 2 nodes .* this job has 1 node\(s\) of 1 rank\(s\)"):
        create_checkpoint_manager(fields)


def test_damaged_copy_found_while_sending_is_not_used(tmp_path: Path, reference: Path, killed: Path) -> None:
    """The holder checks a copy it sends as it reads it (one read): a damaged one is dropped, an older step used."""
    run, out = restart(tmp_path, killed)
    newest = newest_replicated(run / "node0")
    older = sorted(
        json.loads(p.read_text())["step"] for p in (run / "node0" / ".replicas").glob("*/committed.json")
    )[-2]
    shutil.rmtree(run / "node1")  # node 1 pulls everything from node 0
    (run / "node1").mkdir()
    data = sorted((run / "node0" / ".replicas" / f"step_{newest:08d}" / "rank_00002").glob("*.distcp"))
    assert data, "rank 2 wrote no data file"
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 3] ^= 0x01  # the only copy of rank 2's share of the newest step left
    data[0].write_bytes(bytes(raw))
    (run / "durable").rename(run.parent / "durable-away")  # an older local step, not the durable tier
    job = Job(run, out, STEPS)
    job.start()
    job.wait(JOB_TIMEOUT)
    assert result(out)["resumed"] == {"step": older, "path": str(run / "local" / f"step_{older:08d}")}
    text = logs(out)
    assert f"the copy of rank 2's share of local step {newest} on node 0 is damaged" in text
    assert "rank 2's share from node 0 arrived damaged" in text
    assert f"pulled rank 2's share of local step {older} from node 0" in text
    assert_bit_exact(out, reference)


# -- hostile states of the store: each copy refused on its own, every rank falls back together ----------


def resumed(run: Path, out: Path) -> dict[str, Any]:
    """Start the job again on ``run``; what it resumed from."""
    job = Job(run, out, STEPS)
    job.start()
    job.wait(JOB_TIMEOUT)
    return dict(result(out)["resumed"])


def test_replica_resume_links_fifos_and_nesting_fall_back_to_the_next_copy(
    tmp_path: Path, reference: Path, killed: Path
) -> None:
    """Node 1's copy of the newest step: rank 2's data file a symlink to an identical copy (the holder
    would read it through the link), rank 3's JSON a FIFO (a read never returns); node 0's marker of
    that step nested 5,000 deep. Node 1's marker decides, node 0's copies of shares 2 and 3 are
    pulled, on every rank together: no collective times out, and the run ends bit-exact."""
    run, out = restart(tmp_path, killed)
    newest = max(newest_replicated(run / "node0"), newest_replicated(run / "node1"))
    name = f"step_{newest:08d}"
    node1 = run / "node1" / ".replicas" / name
    data = sorted((node1 / "rank_00002").glob("*.distcp"))[0]
    copy = tmp_path / "outside.distcp"
    shutil.copy(data, copy)
    data.unlink()
    data.symlink_to(copy)
    rank_json = node1 / "rank_00003" / "rank_00003.json"
    rank_json.unlink()
    os.mkfifo(rank_json)
    (run / "node0" / ".replicas" / name / "committed.json").write_text("[" * 5000 + "]" * 5000)
    assert resumed(run, out) == {"step": newest, "path": str(run / "local" / name)}
    text = logs(out)
    assert f"pulled rank 2's share of local step {newest} from node 0" in text
    assert f"pulled rank 3's share of local step {newest} from node 0" in text
    assert "CollectiveTimeoutError" not in text and "timed out" not in text
    assert_bit_exact(out, reference)


def test_replica_resume_wrong_types_and_truncation_fall_back_to_durable(
    tmp_path: Path, reference: Path, killed: Path
) -> None:
    """Node 1 replaced (an empty disk); node 0's markers: the newest step's ``manifests`` a list, the
    older one cut short. No local step is committed anywhere: the durable tier, bit-exact."""
    run, out = restart(tmp_path, killed)
    shutil.rmtree(run / "node1")
    (run / "node1").mkdir()
    markers = sorted((run / "node0" / ".replicas").glob("*/committed.json"))
    assert len(markers) == 2
    older, newer = sorted(markers, key=lambda p: json.loads(p.read_text())["step"])
    bad = json.loads(newer.read_text())
    bad["manifests"] = list(bad["manifests"].values())
    newer.write_text(json.dumps(bad))
    older.write_bytes(older.read_bytes()[: len(older.read_bytes()) // 2])
    durable = sorted(run.glob("durable/step_*"))[-1]
    assert resumed(run, out) == {"step": int(durable.name[5:]), "path": str(durable)}
    text = logs(out)
    seen = run / "local" / ".replicas"  # where node 0's processes see its disk
    assert f"{seen / newer.parent.name / 'committed.json'}: not used ('manifests' is not one object per rank 0..3)" in text
    assert f"{seen / older.parent.name / 'committed.json'}: not used (" in text and "not valid JSON" in text
    assert "CollectiveTimeoutError" not in text and "timed out" not in text
    assert_bit_exact(out, reference)


# ---- save_frozen="once" with replicas ------------------------------------------------------------


@pytest.fixture(scope="module")
def frozen_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fine-tuning run (first layer frozen, save_frozen="once") that never stopped."""
    root = tmp_path_factory.mktemp("frozen-reference")
    job = Job(root / "run", root / "out", STEPS, extra=("--frozen",))
    job.start()
    job.wait(JOB_TIMEOUT)
    return root / "out"


def test_frozen_base_is_held_once_per_node_and_resumes_from_peers_after_its_writer_retired(
    tmp_path: Path, frozen_reference: Path
) -> None:
    """Six steps with keep_last=2: step 1 wrote the frozen files and is retired everywhere. Every
    node's replica store holds each kept step's shares whole (each file as its manifest records it),
    the frozen files once per node however many steps use them (a copy a node holds already is
    linked, not sent again); a replaced node resumes from its peer's copies, bit-exact to the run
    that never stopped."""
    run = tmp_path / "run"
    job = Job(run, tmp_path / "first", 6, extra=("--frozen",))
    job.start()
    job.wait(JOB_TIMEOUT)
    kept = ["step_00000005", "step_00000006"]
    node0 = run / "node0"
    assert sorted(p.name for p in node0.glob("step_*")) == kept
    frozen_files: set[tuple[int, str]] = set()
    for node in (0, 1):  # two nodes, one replica each: every node holds every rank's share
        store = run / f"node{node}" / ".replicas"
        assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) == kept
        for name in kept:
            manifests = json.loads((store / name / "committed.json").read_text())["manifests"]
            for rank in range(4):
                for rel, recorded in manifests[str(rank)].items():
                    path = store / name / f"rank_{rank:05d}" / rel
                    assert path.stat().st_size == recorded["size"], (node, name, rank, rel)
                    assert file_crc(path) == recorded["crc32"], (node, name, rank, rel)
                    if rel.endswith("_frozen.distcp"):
                        frozen_files.add((rank, rel))
        for rank, rel in frozen_files:  # one file per node for both kept steps
            copies = [os.stat(store / name / f"rank_{rank:05d}" / rel) for name in kept]
            assert copies[0].st_ino == copies[1].st_ino, (node, rank, rel)
    assert frozen_files, "no rank wrote a frozen file"
    shutil.rmtree(run / "node1")  # the node is replaced: an empty local disk
    (run / "node1").mkdir()
    out = tmp_path / "out"
    job = Job(run, out, STEPS, extra=("--frozen",))
    job.start()
    job.wait(JOB_TIMEOUT)
    assert result(out)["resumed"] == {"step": 6, "path": str(run / "local" / "step_00000006")}
    assert "resumed from the local tiers" in logs(out)
    assert_bit_exact(out, frozen_reference)
