"""Hostile on-disk states of a node's replica store: each copy is refused on its own, never a crash.

``test_replica_store_*`` need one process: what a node reports of its store (markers, held shares)
when links, special files, wrong JSON types, deep nesting or truncation sit where the replication
put its files. ``test_replica_resume_*`` run the real 2-node job on loopback (as ``test_replicas``
does): the resume falls back to the next copy, an older step or the durable tier on every rank
together, bit-exact, with no rank left waiting in a collective.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from cm_tiered.replicas import MARKER, ReplicaStore, decide

from checkpoint_manager.core.checksum import crc32

NAME = "step_00000007"


def _store(tmp_path: Path, world: int = 2) -> tuple[ReplicaStore, dict[str, Any]]:
    """A node's store holding every share of one committed step, as a replication leaves it."""
    store = ReplicaStore(tmp_path / "local", fsync=False)
    manifests: dict[str, dict[str, dict[str, int]]] = {}
    for rank in range(world):
        share = store.share(NAME, rank)
        share.mkdir(parents=True)
        files = {f"__{rank}_0.distcp": bytes([rank]) * (100 + rank), f"rank_{rank:05d}.json": b"{}"}
        for rel, data in files.items():
            (share / rel).write_bytes(data)
        manifests[str(rank)] = {rel: {"size": len(d), "crc32": crc32(d)} for rel, d in files.items()}
    marker = {"step": 7, "name": NAME, "world_size": world, "replicas": 1, "nodes": [0, 1][:world],
              "local_ranks": [0] * world, "manifests": manifests}
    store.write_marker(NAME, marker)
    return store, marker


def test_replica_store_an_intact_step_is_reported_whole(tmp_path: Path) -> None:
    store, marker = _store(tmp_path)
    assert store.marker(NAME) == marker
    assert store.holdings() == {NAME: {"0": {"__0_0.distcp": 100, "rank_00000.json": 2},
                                       "1": {"__1_0.distcp": 101, "rank_00001.json": 2}}}


def _set(marker: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``marker`` with the field at ``path`` (keys joined by ``/``) set to ``value``."""
    node: Any = marker
    *head, last = path.split("/")
    for part in head:
        node = node[part]
    node[last] = value
    return marker


BAD_MARKERS = {
    "manifests_a_list": (lambda m: _set(m, "manifests", []), "'manifests' is not one object per rank 0..1"),
    "a_manifest_a_list": (lambda m: _set(m, "manifests/1", [1]), "the manifest of rank 1 is not an object"),
    "a_rank_missing": (lambda m: m["manifests"].pop("1") and m, "'manifests' is not one object per rank 0..1"),
    "step_a_string": (lambda m: _set(m, "step", "7"), "'step' missing or not a non-negative integer"),
    "step_a_bool": (lambda m: _set(m, "step", True), "'step' missing or not a non-negative integer"),
    "world_size_zero": (lambda m: _set(m, "world_size", 0), "'world_size' missing or not a positive integer"),
    "size_a_string": (lambda m: _set(m, "manifests/0/__0_0.distcp/size", "100"), "records '__0_0.distcp'"),
    "crc_too_large": (lambda m: _set(m, "manifests/0/__0_0.distcp/crc32", 1 << 32), "records '__0_0.distcp'"),
    "a_file_outside": (lambda m: m["manifests"]["0"].update({"../../escape": {"size": 1, "crc32": 0}}) or m,
                       "names '../../escape', outside the share"),
    "nodes_strings": (lambda m: _set(m, "nodes", ["0", "1"]), "'nodes' is not a list of non-negative integers"),
    "not_an_object": (lambda m: [m], "holds a JSON list, not an object"),
}


@pytest.mark.parametrize("case", sorted(BAD_MARKERS))
def test_replica_store_a_marker_of_wrong_types_is_no_marker(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    store, marker = _store(tmp_path)
    change, problem = BAD_MARKERS[case]
    (store.step_dir(NAME) / MARKER).write_text(json.dumps(change(marker)))
    with caplog.at_level(logging.WARNING, logger="cm_tiered"):
        assert store.marker(NAME) is None
    assert f"{store.step_dir(NAME) / MARKER}: not used (" in caplog.text and problem in caplog.text


@pytest.mark.parametrize(
    "content",
    [b"[" * 5000 + b"]" * 5000, b'{"step": 7, "manifests": {"0": {"__0_0.dis', b"\xff\xfe", b""],
    ids=["deep_nesting", "truncated", "not_utf8", "empty"],
)
def test_replica_store_a_marker_that_is_no_json_is_no_marker(tmp_path: Path, content: bytes) -> None:
    store, _ = _store(tmp_path)
    (store.step_dir(NAME) / MARKER).write_bytes(content)
    assert store.marker(NAME) is None
    reports = [{"node": 0, "markers": {}, "holdings": store.holdings()}]
    assert decide(reports, 2, None, set()) == (None, [])


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_replica_store_a_marker_that_is_no_regular_file_is_no_marker(tmp_path: Path, kind: str) -> None:
    store, marker = _store(tmp_path)
    file = store.step_dir(NAME) / MARKER
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(marker))
    file.unlink()
    if kind == "symlink":
        file.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(file)  # a read would block forever
    else:
        file.mkdir()
    assert store.marker(NAME) is None


def _replace_with(path: Path, kind: str, tmp_path: Path) -> None:
    """``path`` (a share's file) replaced: by a link to a copy of itself, a FIFO, or a dangling link."""
    copy = tmp_path / f"copy-of-{path.name}"
    shutil.copy(path, copy)
    path.unlink()
    if kind == "symlink_to_a_copy":
        path.symlink_to(copy)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "nothing-here")


@pytest.mark.parametrize("kind", ["symlink_to_a_copy", "fifo", "dangling_symlink"])
def test_replica_store_a_share_file_that_is_no_regular_file_is_not_held(tmp_path: Path, kind: str) -> None:
    store, marker = _store(tmp_path)
    _replace_with(store.share(NAME, 1) / "__1_0.distcp", kind, tmp_path)
    held = store.holdings()[NAME]
    assert held["1"] == {"rank_00001.json": 2} and held["0"] == {"__0_0.distcp": 100, "rank_00000.json": 2}
    reports = [{"node": 0, "markers": {NAME: marker}, "holdings": store.holdings()}]
    pick, why = decide(reports, 2, None, set())
    assert pick is None and why == [f"local step 7 ({NAME}): no surviving intact copy of the share of rank(s) 1"]
    assert any("__1_0.distcp: missing, or not a regular file" in p for p in store.verify(str(store.step_dir(NAME)), "sizes"))


def test_replica_store_linked_and_strange_directories_are_not_shares(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    step = store.step_dir(NAME)
    moved = tmp_path / "moved-share"
    shutil.move(str(store.share(NAME, 1)), moved)
    (step / "rank_00001").symlink_to(moved)  # the share itself a link
    (step / "rank_abc").mkdir()  # no rank
    (step / "rank_0000").mkdir()  # not five digits
    other = tmp_path / "other-step"
    shutil.copytree(step, other, symlinks=True)
    (store.root / "step_00000009").symlink_to(other)  # a step directory that is a link
    assert store.names() == [NAME]
    assert store.holdings() == {NAME: {"0": {"__0_0.distcp": 100, "rank_00000.json": 2}}}


def test_replica_store_a_store_root_that_is_a_file_holds_nothing(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "local", fsync=False)
    (tmp_path / "local").mkdir()
    store.root.write_text("not a directory")
    assert store.names() == [] and store.holdings() == {}
