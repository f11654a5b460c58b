"""The data order in one process: ResumableDistributedSampler's partition (a rank is just a sampler
argument), its state, and its interplay with StatefulDataLoader on any number of ranks.

The resharded resume of real gloo jobs: tests/system/distributed/test_data_order.py.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    CheckpointConfig,
    ResumableDistributedSampler,
)
from checkpoint_manager.state.data_order import derived_rng_state, sampler_states
from checkpoint_manager.state.rng import capture_rng

N, BATCH, SEED, STOP = 103, 4, 7, 7  # 103 samples, 4 per rank per step, save at step 7

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def data(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def epoch_order(epoch: int = 0, n: int = N, seed: int = SEED) -> list[int]:
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


# -- the sampler in one process ----------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
def test_from_position_0_it_yields_what_distributed_sampler_yields(shuffle: bool, drop_last: bool, replicas: int) -> None:
    for rank in range(replicas):
        for epoch in (0, 3):
            ours = ResumableDistributedSampler(data(), replicas, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            theirs = DistributedSampler(data(), replicas, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 4, 5])
def test_k_batches_per_rank_in_lock_step_are_a_prefix_of_the_global_order(replicas: int, batch: int) -> None:
    samplers = [ResumableDistributedSampler(data(), replicas, r, seed=SEED) for r in range(replicas)]
    iters = [iter(s) for s in samplers]
    taken: list[int] = []
    for k in range(1, 6):
        for it in iters:
            taken.extend(next(it) for _ in range(batch))
        assert sorted(taken) == sorted(epoch_order()[: k * replicas * batch])
        assert {s.position for s in samplers} == {k * replicas * batch}
        assert samplers[0].state_dict() == {
            "resumable_distributed_sampler": 1, "position": k * replicas * batch, "epoch": 0, "seed": SEED,
            "shuffle": True, "drop_last": False, "dataset_len": N,
        }


def consume(loader: StatefulDataLoader, batches: int) -> tuple[list[int], dict[str, Any]]:
    """``batches`` batches from a fresh iteration of ``loader``, and its state right after."""
    it = iter(loader)
    seen = [i for _ in range(batches) for i in next(it)[0].tolist()]
    state = loader.state_dict()
    del it
    return seen, state


def rest(loader: StatefulDataLoader) -> list[int]:
    return [i for batch in loader for i in batch[0].tolist()]


def padding(remaining: int, replicas: int) -> list[int]:
    """What the last round of ``replicas`` ranks repeats: the epoch's first samples, one per missing slot."""
    return epoch_order()[: (-remaining) % replicas]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("new_replicas", [1, 2, 3, 4])
def test_stateful_dataloader_saves_what_was_consumed_and_resumes_on_any_number_of_ranks(
    workers: int, new_replicas: int
) -> None:
    """With workers, the sampler runs ahead (prefetch); the loader's state is still what was returned."""
    states, first = [], []
    for rank in range(2):
        sampler = ResumableDistributedSampler(data(), 2, rank, seed=SEED)
        loader = StatefulDataLoader(data(), batch_size=BATCH, sampler=sampler, num_workers=workers)
        seen, state = consume(loader, STOP)
        first += seen
        if workers:
            assert sampler.position > STOP * 2 * BATCH  # the workers' prefetch, not consumed
        [saved] = sampler_states(state)
        assert saved["position"] == STOP * 2 * BATCH
        states.append(json.loads(json.dumps(state)))  # as a checkpoint holds it: JSON
    assert sorted(first) == sorted(epoch_order()[: STOP * 2 * BATCH])
    second: list[int] = []
    for rank in range(new_replicas):
        sampler = ResumableDistributedSampler(data(), new_replicas, rank, seed=SEED)
        loader = StatefulDataLoader(data(), batch_size=BATCH, sampler=sampler, num_workers=workers)
        if new_replicas == 2:
            loader.load_state_dict(states[rank])  # the same world size: each rank its own loader state
        else:
            sampler.load_state_dict(sampler_states(states[0])[0])  # what "reshard" sets
        second += rest(loader)
    remaining = N - STOP * 2 * BATCH
    assert Counter(first + second) - Counter(range(N)) == Counter(padding(remaining, new_replicas))
    assert set(first + second) == set(range(N))


def test_same_world_size_resume_yields_the_uninterrupted_order_on_each_rank() -> None:
    for rank in range(2):
        whole = rest(StatefulDataLoader(data(), batch_size=BATCH,
                                        sampler=ResumableDistributedSampler(data(), 2, rank, seed=SEED)))
        loader = StatefulDataLoader(data(), batch_size=BATCH,
                                    sampler=ResumableDistributedSampler(data(), 2, rank, seed=SEED))
        seen, state = consume(loader, STOP)
        again = StatefulDataLoader(data(), batch_size=BATCH,
                                   sampler=ResumableDistributedSampler(data(), 2, rank, seed=SEED))
        again.load_state_dict(state)
        assert seen + rest(again) == whole


def test_epochs_end_at_the_dataset_length_and_set_epoch_starts_the_next_at_0() -> None:
    sampler = ResumableDistributedSampler(data(), 2, 0, seed=SEED, drop_last=True)
    assert len(sampler) == 51 and len(list(sampler)) == 51
    assert sampler.state_dict()["position"] == N  # dropped tail: the epoch is over, not "101"
    assert list(sampler) == list(sampler)  # no set_epoch: the epoch replays, as DistributedSampler's does
    sampler.set_epoch(1)
    assert sampler.state_dict()["position"] == 0 and sampler.state_dict()["epoch"] == 1
    resumed = ResumableDistributedSampler(data(), 3, 2, seed=SEED, drop_last=True)
    resumed.load_state_dict({**sampler.state_dict(), "position": 100})
    assert list(resumed) == [epoch_order(1)[102]] and resumed.position == N
    resumed.load_state_dict({**sampler.state_dict(), "position": 100})
    resumed.set_epoch(1)  # the loaded epoch: set_epoch on resume keeps the position
    assert resumed.position == 100
    resumed.set_epoch(2)
    assert resumed.position == 0 and len(resumed) == 34


@pytest.mark.parametrize(("change", "message"), [
    ({"seed": 8}, "sampler state was saved with seed=8, this sampler has seed=7: the epoch's order would differ"),
    ({"dataset_len": 104}, "sampler state was saved with dataset_len=104, this sampler has dataset_len=103"),
    ({"shuffle": False}, "sampler state was saved with shuffle=False, this sampler has shuffle=True"),
    ({"position": 104, "dataset_len": 103}, "sampler state: position 104 is past the dataset (103)"),
    ({"position": -1}, "sampler state: position is -1, not a non-negative int"),
    ({"resumable_distributed_sampler": 2}, "not a ResumableDistributedSampler state (version 1)"),
])
def test_a_state_of_another_order_is_refused(change: dict[str, Any], message: str) -> None:
    sampler = ResumableDistributedSampler(data(), 2, 0, seed=SEED)
    with pytest.raises(ValueError) as info:
        sampler.load_state_dict({**sampler.state_dict(), **change})
    assert message in str(info.value)
    assert sampler.position == 0


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got 2"):
        ResumableDistributedSampler(data(), 2, 2)
    with pytest.raises(ValueError, match="num_replicas must be a positive int, got 0"):
        ResumableDistributedSampler(data(), 0, 0)
    assert CheckpointConfig(save_dir="/tmp/x", on_world_size_change="reshard").on_world_size_change == "reshard"


def test_derived_rng_is_a_function_of_saved_rank_0_rank_and_world_size() -> None:
    torch.manual_seed(5)
    saved = capture_rng()
    a = derived_rng_state(saved, rank=1, world_size=3)
    b = derived_rng_state(saved, rank=1, world_size=3)
    assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
    assert (a["numpy"][1] == b["numpy"][1]).all()
    others = [derived_rng_state(saved, rank=r, world_size=w) for r, w in ((0, 3), (2, 3), (1, 4))]
    assert all(not torch.equal(a["torch"], o["torch"]) and a["python"] != o["python"] for o in others)
    torch.manual_seed(6)
    assert not torch.equal(a["torch"], derived_rng_state(capture_rng(), rank=1, world_size=3)["torch"])
