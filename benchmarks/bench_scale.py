"""What a save and a load cost the coordinator at thousands of ranks, measured on the library's code.

    .venv/bin/python -m benchmarks.bench_scale --ranks 64,1024,8192 --json scale.json --plot scale.png
    .venv/bin/python -m benchmarks.bench_scale --ranks 64,512 --quick        # the CI configuration
    .venv/bin/python -m benchmarks.bench_scale --anchor 2,4,8,16             # + real gloo jobs

For each rank count N, one process builds what every rank of a job would hand the coordinator for a
Llama-70B-shaped state (80 layers, hidden 8192, intermediate 28672, 64 heads / 8 KV heads, vocab
128256; every parameter and its AdamW moments a DTensor sharded on dim 0 over all N ranks (FSDP2),
or over shard groups of ``--hsdp-shard`` ranks replicated across the others (HSDP); AdamW's step
counts plain tensors on every rank): each rank's local save plan and write results, made by the
planner's and writer's own functions for that rank's mesh coordinate (one rank's plan is checked
against the planner run on real DTensors of a one-process fake group), and each rank's JSON state.
Then it runs the coordinator's steps with the library's functions, as a job runs them on rank 0:

- ``plan``: the ranks' plans merged into DCP's metadata (the global plan, then the storage plan);
- ``metadata``: the ranks' write results merged into ``.metadata``, written;
- ``vote``: every rank's report read and judged;
- ``checkpoint_json``: the file records gathered and ``checkpoint.json`` built and written;
- ``commit``: the pending directory made durable and renamed into place;

and, for a new job, ``discovery`` (the committed checkpoint found and its ``checkpoint.json``
read), ``verify`` (sizes) and ``load_plan`` (one rank's load planning: its checks, the index read,
its read plan) at the same and at half the world size. What crosses the wire in a job is measured
here as the bytes each rank sends and receives, and the (de)serializing the coordinator does.

A step's peak memory is the rise of the process's peak RSS (``/proc/self/clear_refs``) plus what
the coordinator holds of the ranks' inputs. A time or memory exponent is the slope of a log-log
least-squares fit over the rank counts. Steps whose memory, projected from the smaller rank counts,
would exceed ``--max-gib`` are not run at a larger count: that is itself reported.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.tensor import Replicate, Shard

from checkpoint_manager.core.codec import encode
from checkpoint_manager.core.layout import CHECKPOINT_JSON, Lineage, rank_file, seal_checkpoint_json
from checkpoint_manager.engine.dcp.planner import FastSavePlanner, nest
from checkpoint_manager.engine.dcp.shards import shard_chunk, shard_write_item
from checkpoint_manager.engine.dcp.writer import record_layout
from checkpoint_manager.state.rng import capture_rng
from checkpoint_manager.storage.base import json_bytes
from checkpoint_manager.storage.local import LocalStorage

REPO = Path(__file__).resolve().parent.parent
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# -- the state ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One tensor of the state: its key, global shape, and whether it is a DTensor shard."""

    fqn: str
    shape: tuple[int, ...]
    sharded: bool


def llama_keys(
    layers: int = 80, hidden: int = 8192, inter: int = 28672, heads: int = 64, kv_heads: int = 8, vocab: int = 128256
) -> list[Key]:
    """A Llama-shaped model and its AdamW state, as the manager keys them (model, then optimizer)."""
    head = hidden // heads
    params: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        params += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv_heads * head, hidden)),
            (p + "self_attn.v_proj.weight", (kv_heads * head, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    params += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    keys = [Key(f"model.{name}", shape, True) for name, shape in params]
    for name, shape in params:
        keys += [
            Key(f"optim.state.{name}.exp_avg", shape, True),
            Key(f"optim.state.{name}.exp_avg_sq", shape, True),
            Key(f"optim.state.{name}.step", (), False),
        ]
    return keys


def tiny_keys() -> list[Key]:
    """The anchor jobs' state: the same structure, 2 layers of width 64."""
    return llama_keys(layers=2, hidden=64, inter=128, heads=4, kv_heads=2, vocab=256)


@dataclass(frozen=True)
class Sharding:
    """How the ranks hold the DTensors: FSDP2 (one mesh dimension of all ranks) or HSDP."""

    name: str
    world: int
    shard_group: int  # ranks one DTensor is sharded over (the world for FSDP2)

    @cached_property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.shard_group >= self.world:
            return (self.world,)
        return (self.world // self.shard_group, self.shard_group)

    @cached_property
    def placements(self) -> tuple[Any, ...]:
        return (Shard(0),) if len(self.mesh_shape) == 1 else (Replicate(), Shard(0))

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return (rank,) if len(self.mesh_shape) == 1 else divmod(rank, self.shard_group)


_PROPS = TensorProperties(dtype=torch.float32, requires_grad=False)


def rank_plan(keys: list[Key], sharding: Sharding, rank: int, plain: list[WriteItem]) -> SavePlan:
    """Rank ``rank``'s local save plan, from the planner's own item builders: DTensor shards at the
    rank's mesh coordinate (``shard_chunk``, ``shard_write_item``), plain tensors as the planner
    plans them (``plain``: its items for the step counts, the same on every rank)."""
    coordinate = sharding.coordinate(rank)
    items: list[WriteItem] = []
    plain_items = iter(plain)
    for key in keys:
        if not key.sharded:
            items.append(next(plain_items))
            continue
        chunk = shard_chunk(key.shape, sharding.mesh_shape, coordinate, sharding.placements)
        assert chunk is not None
        items.append(shard_write_item(key.fqn, torch.Size(key.shape), _PROPS, chunk))
    return SavePlan(items, planner_data={k.fqn: (k.fqn,) for k in keys})


def plain_items(keys: list[Key]) -> list[WriteItem]:
    """The planner's items for the plain tensors of the state (the step counts), as every rank plans them."""
    planner = FastSavePlanner()
    planner.set_up_planner(nest({k.fqn: torch.tensor(1.0) for k in keys if not k.sharded}), None, False)
    return list(planner.create_local_plan().items)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))


def rank_json_bytes(records: dict[str, dict[str, int]]) -> bytes:
    """A rank's JSON state as the save writes it: its RNG state (the library's encoding) and its files."""
    return json_bytes({"rng": encode(capture_rng()), "files": records})


# -- measuring ----------------------------------------------------------------------------------------


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass
class Measured:
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    peak_bytes: int = 0


@contextmanager
def measure(into: Measured) -> Iterator[None]:
    """Time the block and record the rise of the process's peak RSS over its RSS at the start."""
    gc.collect()
    _reset_peak()
    base = _rss()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        into.seconds.append(time.perf_counter() - t0)
        into.cpu_seconds.append(time.process_time() - c0)
        into.peak_bytes = max(into.peak_bytes, _peak_rss() - base)


def fit_exponent(points: list[tuple[float, float]]) -> float | None:
    """The slope of log(y) against log(x), least squares (None with fewer than two usable points)."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


# -- one rank count: the ranks' inputs, then the coordinator's steps ----------------------------------


@dataclass
class Scenario:
    """Everything the ranks of one job (``sharding.world`` ranks) hand the coordinator."""

    keys: list[Key]
    sharding: Sharding
    root: Path
    table: Any = None  # the KeyTable every rank holds
    mappings: dict[str, Any] = field(default_factory=dict)
    reports: list[bytes] = field(default_factory=list)  # each rank's chunk report (a first save's gather)
    ends: list[int] = field(default_factory=list)  # each rank's file size
    merged: Any = None  # the coordinator's merge of a first save
    written: Any = None  # the files of the last save, kept open (what a save with the plan reused copies)

    @property
    def world(self) -> int:
        return self.sharding.world


def _job(step: int = 1000) -> Any:
    from checkpoint_manager.lifecycle.job import SaveJob
    from checkpoint_manager.state.training import GatheredState

    state = GatheredState({}, {}, {}, {"step": step, "epoch": 0, "consumed_samples": 0, "flops": 0.0, "counters": {}})
    return SaveJob(step, f"step={step:08d}", None, state, {"loss": 1.0}, time.perf_counter())


def build(keys: list[Key], sharding: Sharding, root: Path, steps: dict[str, Measured]) -> Scenario:
    """Every rank's chunk report, from the planner's, the multi-rank rules' and the writer's own
    functions for that rank (timed as ``inputs``); rank 1's items are checked against the planner
    run on real DTensors."""
    from checkpoint_manager.engine.dcp.chunks import data_file
    from checkpoint_manager.engine.dcp.multirank import RankPlans, assign_plain, keep_item, rank_report

    sc = Scenario(keys, sharding, root)
    real, tensors = real_rank(keys, sharding, 1)
    sc.table, sc.mappings = real.keys, real.mappings
    table = sc.table
    with measure(steps["inputs"]):
        plain = plain_items(keys)
        assigned = assign_plain(table, sharding.world)
        for rank in range(sharding.world):
            items = rank_plan(keys, sharding, rank, plain).items
            coordinate = sharding.coordinate(rank)
            kept = [
                k for k in range(len(items))
                if keep_item(table, k, coordinate if keys[k].sharded else None, rank, assigned)
            ]
            plans = RankPlans(keys=table, items=[items[k] for k in kept], ordinals=kept)
            laid = record_layout(plans.items, data_file(rank))
            assert laid is not None
            if rank == 1:
                assert plans.items == real.items, "the benchmark's items differ from the planner's"
            sc.reports.append(rank_report(plans, [(laid[0][i.index].offset, laid[0][i.index].length) for i in plans.items]))
            sc.ends.append(laid[1])
    del tensors
    return sc


def real_rank(keys: list[Key], sharding: Sharding, rank: int, *, timed: Measured | None = None,
              reused: Measured | None = None, dcp_helper: Measured | None = None) -> tuple[Any, dict[str, Any]]:
    """Rank ``rank``'s plans (:func:`plan_rank` on real DTensors, meta storage, of a fake group of
    ``sharding.world`` ranks) and its state. ``timed``: the first planning's time; ``reused``: a
    second one's (the structure unchanged); ``dcp_helper``: DCP's own per-DTensor item helper on the
    same tensors (what the planner called for DTensors before ``shard_chunk``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from checkpoint_manager.engine.dcp.multirank import RankPlans, plan_rank

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=sharding.world)
    try:
        mesh = init_device_mesh("cpu", sharding.mesh_shape)
        flat: dict[str, torch.Tensor] = {}
        for key in keys:
            if not key.sharded:
                flat[key.fqn] = torch.tensor(1.0)
                continue
            chunk = shard_chunk(key.shape, sharding.mesh_shape, sharding.coordinate(rank), sharding.placements)
            assert chunk is not None
            flat[key.fqn] = DTensor.from_local(
                torch.empty(chunk[0], device="meta"), mesh, sharding.placements, run_check=False,
                shape=torch.Size(key.shape), stride=_contiguous_stride(key.shape),
            )
        if dcp_helper is not None:
            from torch.distributed.checkpoint.planner_helpers import _create_write_items

            with measure(dcp_helper):
                for fqn, t in flat.items():
                    _create_write_items(fqn, t)
        plans = RankPlans()
        with measure(timed if timed is not None else Measured()):
            planner = FastSavePlanner()
            planner.set_up_planner(nest(flat), None, rank == 0)
            plan_rank(plans, flat, planner, rank, sharding.world)
        assert plans.keys is not None
        with measure(reused if reused is not None else Measured()):
            planner = FastSavePlanner()
            planner.set_up_planner(nest(flat), None, rank == 0)
            assert plan_rank(plans, flat, planner, rank, sharding.world)
        return plans, flat
    finally:
        dist.destroy_process_group()


def run_save(sc: Scenario, steps: dict[str, Measured], wire: dict[str, int], *, first: bool) -> Path:
    """The coordinator's steps of one save, as rank 0 runs them: a first save merges the ranks'
    chunk reports (the gather), a save with the plan reused writes from the last merge."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    from checkpoint_manager.core.dist import VOTE_SLOT, decode_slots, encode_slot, vote_outcome
    from checkpoint_manager.core.integrity import file_crc32
    from checkpoint_manager.engine.dcp.chunk_index import INDEX_FILE, write_index
    from checkpoint_manager.engine.dcp.chunks import ChunkTable, data_file, write_metadata
    from checkpoint_manager.lifecycle.describe import checkpoint_record, voted_records
    from checkpoint_manager.lifecycle.write import vote_report

    n = sc.world
    tag = "first" if first else "reused"
    storage = LocalStorage(sc.root, fsync=True)
    pending = storage.new_pending("step=00001000")
    wire["exchange"] = 8 * 8  # the all-reduce: eight int64 each way
    if first:
        wire["reports_up"] = max(len(r) for r in sc.reports)
        with measure(steps["merge"]):
            sc.merged = ChunkTable.merge(sc.table, sc.reports)
    with measure(steps[f"metadata_{tag}"]):
        sources = (sc.merged, sc.merged) if first else sc.written
        _, _, written_metadata = write_metadata(
            pending / ".metadata", sources[0], planner_data=sc.mappings,
            storage_meta=StorageMeta(checkpoint_id=pending, save_id="bench"),
        )
        _, _, written_index = write_index(pending / INDEX_FILE, sources[1])
        if sc.written is not None:
            for file in sc.written:
                file.close()
        sc.written = (written_metadata, written_index)
        if first:
            sc.merged = None  # the coordinator keeps the files, not the merge
    # the data files (sparse: their sizes are what matters) and every rank's JSON, as the ranks write
    # them, and the votes they send (their file records)
    slots = []
    for rank, end in enumerate(sc.ends):
        name = data_file(rank)
        with open(pending / name, "wb") as f:
            f.truncate(end)
        own = pending / rank_file(rank)
        own.write_bytes(rank_json_bytes({name: {"size": end, "crc32": rank}}))
        report = vote_report(
            {name: {"size": end, "crc32": rank}}, rank_file(rank), {"size": own.stat().st_size, "crc32": file_crc32(own)}
        )
        slots.append(encode_slot({"report": report}, VOTE_SLOT))
    wire["vote_up"] = VOTE_SLOT
    with measure(steps[f"vote_{tag}"]):
        votes = decode_slots(slots)
        assert vote_outcome(votes, "vote") is None
    del slots
    job = _job()
    with measure(steps[f"checkpoint_json_{tag}"]):
        storage.write_json(pending / "state.json", {"train_state": job.state.train_state})
        files = storage.describe_files(pending, voted_records(votes))
        meta = checkpoint_record(
            job, engine="dcp", engine_record={"writer": "checkpoint-manager-direct/1"}, world_size=n,
            lineage=Lineage(1, ((1, 1),)), parent=None, ranking=None, files=files,
        )
        storage.write_json(pending / CHECKPOINT_JSON, seal_checkpoint_json(meta))
    with measure(steps[f"commit_{tag}"]):
        final_path = storage.commit(pending, job.name)
    return final_path


def per_rank_share(sc: Scenario, steps: dict[str, Measured], wire: dict[str, int]) -> None:
    """One non-coordinator rank's own share of a save: its plan (:func:`plan_rank` on real DTensors),
    its report and vote, and its JSON state (written, then read back for its CRC)."""
    from checkpoint_manager.core.dist import VOTE_SLOT, encode_slot
    from checkpoint_manager.core.integrity import file_crc32
    from checkpoint_manager.engine.dcp.chunks import data_file
    from checkpoint_manager.engine.dcp.multirank import rank_report
    from checkpoint_manager.lifecycle.write import vote_report

    rank = 1
    plans, _ = real_rank(
        sc.keys, sc.sharding, rank, timed=steps["rank_plan_first"], reused=steps["rank_plan_reused"],
        dcp_helper=steps["rank_plan_dcp_helper"],
    )
    laid = record_layout(plans.items, data_file(rank))
    assert laid is not None
    layout = [(laid[0][i.index].offset, laid[0][i.index].length) for i in plans.items]
    raw = rank_json_bytes({data_file(rank): {"size": laid[1], "crc32": 1}})
    with tempfile.TemporaryDirectory() as tmp:
        own = Path(tmp) / rank_file(rank)
        for tag in ("first", "reused"):
            with measure(steps[f"rank_share_{tag}"]):
                if tag == "first":
                    report = rank_report(plans, layout)
                    torch.frombuffer(bytearray(report), dtype=torch.uint8).clone()  # its gather slot
                with open(own, "wb") as f:
                    f.write(raw)
                    f.flush()
                    os.fsync(f.fileno())
                vote = vote_report({data_file(rank): {"size": laid[1], "crc32": 1}}, rank_file(rank),
                                   {"size": own.stat().st_size, "crc32": file_crc32(own)})
                encode_slot({"report": vote}, VOTE_SLOT)
    wire["rank_json"] = len(raw)


def run_load(sc: Scenario, path: Path, steps: dict[str, Measured], world: int, tag: str) -> None:
    """One rank's load planning of the checkpoint at ``path`` in a job of ``world`` ranks: what it
    reads and checks itself (``checkpoint.json``, its JSON state, the engine's index) and its read
    plan, as the manager and the DCP engine run them (rank 0's check of every file is ``verify``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from checkpoint_manager.core.layout import read_checkpoint_json
    from checkpoint_manager.engine.base import EngineContext
    from checkpoint_manager.engine.dcp.engine import _INDEX, DCPEngine
    from checkpoint_manager.engine.dcp.planner import FastLoadPlanner
    from checkpoint_manager.state.training import read_rank_json

    sharding = Sharding(sc.sharding.name, world, min(sc.sharding.shard_group, world))
    rank = world // 2 + 1 if world > 2 else world - 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", sharding.mesh_shape)
        targets: dict[str, torch.Tensor] = {}
        for key in sc.keys:
            if not key.sharded:
                targets[key.fqn] = torch.tensor(0.0)
                continue
            chunk = shard_chunk(key.shape, sharding.mesh_shape, sharding.coordinate(rank), sharding.placements)
            assert chunk is not None
            targets[key.fqn] = DTensor.from_local(
                torch.empty(chunk[0], device="meta"), mesh, sharding.placements, run_check=False,
                shape=torch.Size(key.shape), stride=_contiguous_stride(key.shape),
            )
        engine = DCPEngine()
        with measure(steps[f"load_plan_{tag}"]):
            meta = read_checkpoint_json(path)
            read_rank_json(path, rank if world == sc.world else 0, meta=meta, level="sizes")
            ctx = EngineContext(step=1000, rank=rank, world_size=world, meta=meta, extra={})
            engine.read_index(path, ctx)
            partial = ctx.extra[_INDEX][1].metadata_for(targets)
            planner = FastLoadPlanner()
            planner.set_up_planner(nest(targets), partial, rank == 0)
            plan = planner.create_local_plan()
        assert plan.items
        if world == sc.world:  # at the same world size each shard is one saved chunk (or none: empty)
            assert len(plan.items) <= len(targets), (len(plan.items), len(targets))
    finally:
        dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------------

#: --quick: the model's layers (the shapes stay Llama-70B's; every figure scales with the layers alike)
QUICK_LAYERS = 8

REUSED_STEPS = ("metadata_reused", "vote_reused", "checkpoint_json_reused", "commit_reused")
FIRST_STEPS = ("merge", "metadata_first", "vote_first", "checkpoint_json_first", "commit_first")
SAVE_STEPS = FIRST_STEPS + REUSED_STEPS


def _median(m: Measured) -> float | None:
    """The step's median CPU seconds: the coordinator's own work (the process runs one thread; on a
    shared machine its wall time also counts other users' processes). Waits on the disk (the
    commit's fsyncs) are not in it: the wall seconds are kept beside it."""
    if not m.seconds:
        return None
    return statistics.median(m.cpu_seconds)


def measure_ranks(
    keys: list[Key], sharding: Sharding, scratch: Path, repeats: int, *, load: bool = True
) -> dict[str, Any]:
    """Every figure of one rank count: the steps' median seconds and peak memory, the wire sizes."""
    steps: dict[str, Measured] = {
        name: Measured()
        for name in (
            "inputs", *SAVE_STEPS, "discovery", "verify", "load_plan_same", "load_plan_half", "rank_plan_first",
            "rank_plan_reused", "rank_plan_dcp_helper", "rank_share_first", "rank_share_reused",
        )
    }
    wire: dict[str, int] = {}
    root = scratch / f"{sharding.name}-{sharding.world}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sc = build(keys, sharding, root, steps)
    inputs_bytes = sum(len(r) for r in sc.reports)
    path: Path | None = None
    for _ in range(repeats):
        for first in (True, False):
            if path is not None:
                shutil.rmtree(path)
            path = run_save(sc, steps, wire, first=first)
    assert path is not None
    from checkpoint_manager.core import layout
    from checkpoint_manager.core.integrity import verify

    storage = LocalStorage(root)
    for _ in range(repeats):
        layout._scan_cache.clear()  # a new job: nothing parsed yet
        with measure(steps["discovery"]):
            infos, bad = storage.scan()
        assert len(infos) == 1 and not bad
        with measure(steps["verify"]):
            problems = verify(path, "sizes")
        assert not problems, problems
    if load:
        for _ in range(repeats):
            run_load(sc, path, steps, sharding.world, "same")
            if sharding.world >= 4:
                run_load(sc, path, steps, sharding.world // 2, "half")
    per_rank_share(sc, steps, wire)
    out: dict[str, Any] = {
        "ranks": sharding.world,
        "sharding": sharding.name,
        "shard_group": sharding.shard_group,
        "steps": {
            name: {"s": _median(m), "wall_s": statistics.median(m.seconds), "peak_mib": m.peak_bytes / 2**20}
            for name, m in steps.items()
            if m.seconds
        },
        "wire_bytes": wire,
        "inputs_mib": inputs_bytes / 2**20,
        "metadata_bytes": (path / ".metadata").stat().st_size,
        "index_bytes": (path / ".chunks.safetensors").stat().st_size,
        "checkpoint_json_bytes": (path / CHECKPOINT_JSON).stat().st_size,
    }
    out["coordinator_s"] = {
        "reused": sum(_median(steps[s]) or 0.0 for s in REUSED_STEPS),
        "first": sum(_median(steps[s]) or 0.0 for s in FIRST_STEPS),
    }
    # what the coordinator holds: the steps' own rise, and (first save) the ranks' reports it received
    out["coordinator_peak_mib"] = {
        "reused": max(steps[s].peak_bytes for s in REUSED_STEPS) / 2**20,
        "first": (max(steps[s].peak_bytes for s in FIRST_STEPS) + inputs_bytes) / 2**20,
    }
    out["per_rank_s"] = (_median(steps["rank_plan_reused"]) or 0.0) + (_median(steps["rank_share_reused"]) or 0.0)
    out["per_rank_first_s"] = (_median(steps["rank_plan_first"]) or 0.0) + (_median(steps["rank_share_first"]) or 0.0)
    out["discovery_s"] = _median(steps["discovery"])
    out["verify_s"] = _median(steps["verify"])
    out["load_plan_s"] = {"same": _median(steps["load_plan_same"]), "half": _median(steps["load_plan_half"])}
    out["load_plan_peak_mib"] = steps["load_plan_same"].peak_bytes / 2**20
    shutil.rmtree(root, ignore_errors=True)
    return out


def exponents(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The fitted exponent of each figure in the rank count, per sharding."""
    out: dict[str, float | None] = {}
    for sharding in sorted({r["sharding"] for r in rows}):
        mine = [r for r in rows if r["sharding"] == sharding and "skipped" not in r]
        figures: dict[str, Callable[[dict[str, Any]], float | None]] = {
            "coordinator_s.reused": lambda r: r["coordinator_s"]["reused"],
            "coordinator_s.first": lambda r: r["coordinator_s"]["first"],
            "coordinator_peak_mib.reused": lambda r: r["coordinator_peak_mib"]["reused"],
            "coordinator_peak_mib.first": lambda r: r["coordinator_peak_mib"]["first"],
            "discovery_s": lambda r: r["discovery_s"],
            "verify_s": lambda r: r["verify_s"],
            "load_plan_s.same": lambda r: r["load_plan_s"]["same"],
            "load_plan_s.half": lambda r: r["load_plan_s"]["half"],
            "per_rank_s": lambda r: r["per_rank_s"],
            "per_rank_first_s": lambda r: r["per_rank_first_s"],
        }
        for step in SAVE_STEPS:
            figures[f"step.{step}"] = lambda r, s=step: (r["steps"].get(s) or {}).get("s")
        for name, get in figures.items():
            pts = [(float(r["ranks"]), v) for r in mine if (v := get(r)) is not None]
            floor = FLOOR_MIB if "_mib" in name else FLOOR_S
            # a figure that stays in the noise at every rank count has no exponent worth fitting
            out[f"{sharding}:{name}"] = fit_exponent(pts) if any(v >= floor for _, v in pts) else None
    return out


#: below these at every rank count a figure is timer and allocator noise: no exponent is fitted
FLOOR_S = 0.005
FLOOR_MIB = 8.0


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of every rank count."""
    head = (
        "| sharding | ranks | coordinator, reused plan (s) | first save (s) | coordinator peak (MiB) | "
        "per rank (s) | `.metadata` | `checkpoint.json` | discovery (s) | verify (s) | load plan (s) same / half |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['sharding']} | {r['ranks']:,} | not run: {r['skipped']} |" + " |" * 8)
            continue
        lp = r["load_plan_s"]
        lines.append(
            f"| {r['sharding']} | {r['ranks']:,} | {r['coordinator_s']['reused']:.3f} | {r['coordinator_s']['first']:.3f} "
            f"| {r['coordinator_peak_mib']['reused']:.0f} / {r['coordinator_peak_mib']['first']:.0f} "
            f"| {r['per_rank_s']:.3f} | {_size(r['metadata_bytes'])} | {_size(r['checkpoint_json_bytes'])} "
            f"| {r['discovery_s']:.3f} | {r['verify_s']:.3f} "
            f"| {_fmt(lp['same'])} / {_fmt(lp['half'])} |"
        )
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Time and memory against ranks, log-log, one line per figure and sharding."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot", file=sys.stderr)
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for sharding in sorted({r["sharding"] for r in rows}):
        mine = [r for r in rows if r["sharding"] == sharding and "skipped" not in r]
        xs = [r["ranks"] for r in mine]
        for label, get in (
            ("coordinator, reused plan", lambda r: r["coordinator_s"]["reused"]),
            ("coordinator, first save", lambda r: r["coordinator_s"]["first"]),
            ("discovery + verify", lambda r: r["discovery_s"] + r["verify_s"]),
            ("load plan (one rank)", lambda r: r["load_plan_s"]["same"]),
            ("per rank", lambda r: r["per_rank_s"]),
        ):
            ax_t.plot(xs, [get(r) for r in mine], marker="o", label=f"{sharding}: {label}")
        ax_m.plot(xs, [r["coordinator_peak_mib"]["first"] for r in mine], marker="o", label=f"{sharding}: coordinator")
        ax_m.plot(xs, [r["load_plan_peak_mib"] for r in mine], marker="o", label=f"{sharding}: load plan")
    for ax, title in ((ax_t, "seconds"), (ax_m, "peak MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="64,1024,8192", help="rank counts, comma-separated")
    ap.add_argument("--sharding", default="fsdp,hsdp", help="fsdp, hsdp or both")
    ap.add_argument("--hsdp-shard", type=int, default=8, help="ranks per HSDP shard group")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help=f"one repeat, {QUICK_LAYERS} layers of the model instead of 80 (the CI configuration)")
    ap.add_argument("--max-gib", type=float, default=8.0, help="skip a rank count whose projected memory exceeds this")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="write the log-log plot here (PNG)")
    ap.add_argument("--anchor", default="", help="also run real gloo jobs at these rank counts (tiny state)")
    ap.add_argument("--scratch", type=Path, help="where the checkpoints are written (a temporary directory)")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",") if x]
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(1)  # one thread, as the coordinator's steps run: CPU seconds are the step's
    keys = llama_keys(layers=QUICK_LAYERS) if args.quick else llama_keys()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="bench_scale_"))
    rows: list[dict[str, Any]] = []
    try:
        for name in [s for s in args.sharding.split(",") if s]:
            done: list[dict[str, Any]] = []
            for n in ranks:
                sharding = Sharding(name, n, n if name == "fsdp" else min(args.hsdp_shard, n))
                projected = _projected_gib(done, n)
                if projected is not None and projected > args.max_gib:
                    row: dict[str, Any] = {
                        "ranks": n, "sharding": name, "skipped": f"projected {projected:.1f} GiB > --max-gib {args.max_gib:g}",
                    }
                else:
                    t0 = time.perf_counter()
                    row = measure_ranks(keys, sharding, scratch, repeats)
                    row["bench_s"] = time.perf_counter() - t0
                    done.append(row)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
                if "steps" in row:
                    print("  steps: " + ", ".join(f"{k} {v['s']:.3f}s/{v['peak_mib']:.0f}MiB" for k, v in row["steps"].items()), flush=True)
        anchors = run_anchors([int(x) for x in args.anchor.split(",") if x], scratch) if args.anchor else []
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    fitted = exponents(rows)
    print(table(rows))
    print("exponents: " + ", ".join(f"{k} {v:.2f}" for k, v in fitted.items() if v is not None))
    if anchors:
        print(anchor_table(anchors))
    result = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": f"llama-70b shapes, {QUICK_LAYERS if args.quick else 80} layers", "tensors": len(keys),
        "repeats": repeats, "results": rows, "exponents": fitted,
        "anchors": anchors,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"json: {args.json}")
    if args.plot:
        plot(rows, args.plot)
    return 0


def _projected_gib(done: list[dict[str, Any]], n: int) -> float | None:
    """The largest step's memory at ``n`` ranks, projected linearly from the largest count run so far."""
    if not done:
        return None
    last = done[-1]
    peak = max(
        [m["peak_mib"] for m in last["steps"].values()] + [last["inputs_mib"]]
    ) + last["inputs_mib"]
    return peak * n / last["ranks"] / 1024


# -- anchors: real gloo jobs ---------------------------------------------------------------------------


def run_anchors(counts: list[int], scratch: Path) -> list[dict[str, Any]]:
    """Real jobs of N gloo processes saving (twice) and loading the tiny state; each rank's save
    records, and the in-process figures of the same steps for the same state and rank count."""
    out = []
    keys = tiny_keys()
    for n in counts:
        job = scratch / f"anchor-{n}"
        shutil.rmtree(job, ignore_errors=True)
        job.mkdir(parents=True)
        procs = []
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
            log = open(job / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "benchmarks.bench_scale_worker", str(job)], cwd=REPO, env=env,
                stdout=log, stderr=subprocess.STDOUT,
            ), log))
        failed = []
        for rank, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = -9
            log.close()
            if code != 0:
                failed.append(rank)
        if failed:
            tail = (job / f"rank{failed[0]}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"anchor job of {n} ranks failed on ranks {failed}:\n{tail}")
        records = [json.loads((job / f"records_{rank}.json").read_text()) for rank in range(n)]
        model = measure_ranks(keys, Sharding("fsdp", n, n), scratch, 3, load=False)
        for step in model["steps"].values():  # the records are wall seconds: so are these
            step.setdefault("wall_s", step["s"])
        out.append({"ranks": n, "records": records, "model": model["steps"]})
        shutil.rmtree(job, ignore_errors=True)
    return out


#: a real save's phases (its record's timings, rank 0) and the in-process steps that model them
ANCHOR_PHASES = (
    ("metadata", ("merge", "metadata_first"), ("metadata_reused",)),
    ("vote", ("vote_first",), ("vote_reused",)),
    ("checkpoint_json", ("checkpoint_json_first",), ("checkpoint_json_reused",)),
    ("rename", ("commit_first",), ("commit_reused",)),
)


def anchor_table(anchors: list[dict[str, Any]]) -> str:
    """Each real job's phases (rank 0's records: the first save, then the median of the saves that
    reused the plan), beside the in-process steps of the same state at the same rank count (wall
    seconds, as the records'). A real vote also waits for the slowest rank's write."""
    lines = [
        "| ranks | save | " + " | ".join(f"{name} real / model (ms)" for name, _, _ in ANCHOR_PHASES) + " |",
        "|---|---|" + "---|" * len(ANCHOR_PHASES),
    ]
    for a in anchors:
        saves = a["records"][0]["saves"]
        for kind, records in (("first", saves[:1]), ("reused", saves[1:])):
            cells = []
            for name, first_steps, reused_steps in ANCHOR_PHASES:
                real = statistics.median(r.get(name, 0.0) for r in records)
                model = sum(a["model"][s]["wall_s"] for s in (first_steps if kind == "first" else reused_steps))
                cells.append(f"{real * 1e3:.1f} / {model * 1e3:.1f}")
            lines.append(f"| {a['ranks']} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
