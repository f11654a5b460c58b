"""The rules of peer replication that need no second node: the peer ring, the resume decision, the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cm_tiered.replicas import NodeTopology, ReplicaStore, decide

from checkpoint_manager.core.checksum import crc32


def topology(nnodes: int, per_node: int, rank: int = 0) -> NodeTopology:
    nodes = tuple(r // per_node for r in range(nnodes * per_node))
    return NodeTopology(rank, nodes, tuple(r % per_node for r in range(nnodes * per_node)))


def test_peer_rule_same_local_rank_next_nodes_round_the_ring() -> None:
    topo = topology(3, 2)
    assert topo.peers(0, 1) == [2] and topo.peers(5, 1) == [1]
    assert topo.peers(1, 2) == [3, 5] and topo.sources(1, 2) == [5, 3]
    for rank in range(6):  # sources is the inverse of peers
        for peer in topo.peers(rank, 2):
            assert rank in topo.sources(peer, 2)


def marker(step: int, world: int = 4) -> dict[str, Any]:
    manifests = {str(r): {f"__{r}_0.distcp": {"size": 10 + r, "crc32": r}} for r in range(world)}
    return {"step": step, "name": f"step_{step:08d}", "world_size": world, "manifests": manifests}


def holding(*ranks: int) -> dict[str, dict[str, int]]:
    return {str(r): {f"__{r}_0.distcp": 10 + r} for r in ranks}


def report(node: int, markers: dict[int, dict[str, Any]], held: dict[int, tuple[int, ...]]) -> dict[str, Any]:
    return {
        "node": node,
        "markers": {f"step_{s:08d}": m for s, m in markers.items()},
        "holdings": {f"step_{s:08d}": holding(*ranks) for s, ranks in held.items()},
    }


def test_newest_step_whose_every_share_survives() -> None:
    # node 1 was lost; node 0 holds its own shares (0, 1) and node 1's replicas (2, 3) of steps 6 and 7
    reports = [report(0, {6: marker(6), 7: marker(7)}, {6: (0, 1, 2, 3), 7: (0, 1, 2, 3)}), report(1, {}, {})]
    pick, why = decide(reports, 4, None, set())
    assert pick is not None and (pick.step, pick.holders) == (7, {0: [0], 1: [0], 2: [0], 3: [0]})
    assert why == []


def test_a_step_missing_a_share_is_skipped_never_mixed() -> None:
    # step 7: rank 3's share survives nowhere (a wrong size counts as missing); step 6 is whole
    partial = holding(0, 1, 2)
    partial["3"] = {"__3_0.distcp": 1}
    reports = [
        {"node": 0, "markers": {"step_00000007": marker(7), "step_00000006": marker(6)},
         "holdings": {"step_00000007": partial, "step_00000006": holding(0, 1, 2, 3)}},
    ]
    pick, why = decide(reports, 4, None, set())
    assert pick is not None and pick.step == 6
    assert why == ["local step 7 (step_00000007): no surviving intact copy of the share of rank(s) 3"]
    pick, why = decide(reports, 4, 7, set())  # pinned: no other step is taken instead
    assert pick is None and why == ["local step 7 (step_00000007): no surviving intact copy of the share of rank(s) 3"]


def test_a_step_saved_at_another_world_size_is_not_resumed() -> None:
    reports = [report(0, {7: marker(7, world=2)}, {7: (0, 1)})]
    pick, why = decide(reports, 4, None, set())
    assert pick is None and why == ["local step 7 was saved by 2 ranks, not 4"]


def test_uncommitted_steps_are_never_picked() -> None:
    # shares of step 8 everywhere, but no node wrote committed.json: its replication never finished
    reports = [report(0, {7: marker(7)}, {7: (0, 1, 2, 3), 8: (0, 1, 2, 3)})]
    pick, _ = decide(reports, 4, None, set())
    assert pick is not None and pick.step == 7


def _store_with(tmp_path: Path, steps: list[int], unmarked: list[int]) -> ReplicaStore:
    store = ReplicaStore(tmp_path)
    for step in steps + unmarked:
        share = store.share(f"step_{step:08d}", 0)
        share.mkdir(parents=True)
        (share / "x").write_bytes(b"x")
        if step in steps:
            store.write_marker(f"step_{step:08d}", {"step": step, "world_size": 1, "manifests": {"0": {"x": {"size": 1, "crc32": crc32(b"x")}}}})
    return store


def test_store_retention_and_a_resume(tmp_path: Path) -> None:
    store = _store_with(tmp_path, [3, 4, 5], [2, 6])
    store.prune(2)  # the newest 2 committed; unfinished ones stay (one may be being placed now)
    assert store.names() == ["step_00000002", "step_00000004", "step_00000005", "step_00000006"]
    store.drop_unfinished()  # a run resumed: 2 and 6 never finished their replication, and never will
    assert store.names() == ["step_00000004", "step_00000005"]
    assert json.loads((tmp_path / ".replicas" / "step_00000004" / "committed.json").read_text())["step"] == 4


@pytest.mark.parametrize("value", [True, -1])
def test_replicas_config_is_a_count(tmp_path: Path, value: Any) -> None:
    from cm_tiered import TieredConfig

    with pytest.raises(ValueError, match="replicas"):
        TieredConfig.model_validate({"save_dir": str(tmp_path / "d"), "local_dir": str(tmp_path / "l"), "replicas": value})
