"""The data order across a change of world size (docs/data-order.md).

:class:`ResumableDistributedSampler` partitions one global order per epoch over the ranks and saves
the *global* position in it, so a checkpoint saved by N ranks resumes on M with no sample of the
epoch skipped or repeated. :func:`reshard_per_rank_state` is what ``on_world_size_change="reshard"``
does with the saved ranks' state: one agreed data position, and per-rank RNG derived by a fixed rule.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Sampler

from checkpoint_manager.core.codec import decode, encode
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointMismatchError
from checkpoint_manager.state.keys import DATALOADER, RNG
from checkpoint_manager.state.rng import check_rng

__all__ = [
    "RESHARD_KEY",
    "ResumableDistributedSampler",
    "derived_rng_state",
    "find_sampler",
    "reshard_per_rank_state",
    "sampler_states",
]

#: marks a state dict as this sampler's, wherever a loader nests it; the value is the format version
_MARKER = "resumable_distributed_sampler"
_VERSION = 1
#: the key of a resharded rank's data position in the per-rank state handed to the StateLoader
RESHARD_KEY = "dataloader_position"
_FIELDS = ("epoch", "seed", "shuffle", "drop_last", "dataset_len")
_RNG_DOMAIN = b"checkpoint-manager/reshard-rng/v1\x00"

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


class ResumableDistributedSampler(Sampler[int]):
    """A :class:`~torch.utils.data.DistributedSampler` whose state is the epoch's *global* position.

    Each epoch has one global order: ``torch.randperm(len(dataset))`` from a ``torch.Generator``
    seeded with ``seed + epoch`` (``range(len(dataset))`` without ``shuffle``), as in
    ``DistributedSampler``. An iteration that starts at global position ``p`` gives rank ``r`` of
    ``num_replicas`` the positions ``p + r, p + r + num_replicas, ...``: after every rank took ``k``
    indices, together they took exactly positions ``p .. p + k * num_replicas - 1`` of the order,
    whatever the batch size. With ``drop_last=False`` the last round is padded (position ``q`` past
    the end holds the order's ``q % len(dataset)``-th sample: the epoch's first samples again), with
    ``drop_last=True`` the positions that do not fill a last round are dropped. From position 0 this
    yields exactly what ``DistributedSampler`` yields.

    :meth:`state_dict` is the position (samples consumed by all ranks together, assuming they step
    in lock-step), the epoch, seed, shuffle, drop_last and dataset length; it holds nothing of the
    rank, so it resumes on any number of ranks. Inside a ``StatefulDataLoader`` the loader saves it
    as of the last batch it *returned* (not what workers prefetched); saved on its own, with a plain
    loader, it is exact only with ``num_workers=0``.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            dist = torch.distributed
            initialized = dist.is_available() and dist.is_initialized()
            if num_replicas is None:
                num_replicas = dist.get_world_size() if initialized else 1
            if rank is None:
                rank = dist.get_rank() if initialized else 0
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._resume_at = 0  # the global position the next iteration starts from
        self._start = 0  # the live iteration's start, and how many indices this rank took from it
        self._taken = 0
        self._live = False
        self._token: object = None

    # -- the order -----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's order. A new epoch starts at position 0; the current one (as loaded
        from a checkpoint) keeps its position, so calling it again on resume is harmless."""
        if epoch != self.epoch:
            self._resume_at, self._live = 0, False
        self.epoch = epoch

    def order(self) -> list[int]:
        """The epoch's global order (the same on every rank and at every world size)."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _count(self, start: int) -> int:
        """Indices each rank takes in an iteration that starts at global position ``start``."""
        remaining = max(0, len(self.dataset) - start)
        if self.drop_last:
            return remaining // self.num_replicas
        return -(-remaining // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        start = self._resume_at
        self._start, self._taken, self._live = start, 0, True
        token = self._token = object()  # the newest iterator is the one whose progress counts
        return self._iterate(start, token)

    def _iterate(self, start: int, token: object) -> Iterator[int]:
        order = self.order()
        n = len(order)
        for j in range(self._count(start)):
            if self._token is token:
                self._taken = j + 1  # counted before it is handed out: a batch in hand is consumed
            yield order[(start + self.rank + j * self.num_replicas) % n]
        if self._token is token:  # exhausted: the next iteration without set_epoch replays the epoch
            self._resume_at = 0

    def __len__(self) -> int:
        if self._live and self._taken < self._count(self._start):
            return self._count(self._start)
        return self._count(self._resume_at)

    @property
    def position(self) -> int:
        """Samples of the epoch's order consumed by all ranks together (``len(dataset)``: epoch done)."""
        if not self._live:
            return self._resume_at
        if self._taken >= self._count(self._start):
            return len(self.dataset)
        return self._start + self._taken * self.num_replicas

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            _MARKER: _VERSION,
            "position": self.position,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global position; the next iteration starts there, on this rank's share."""
        position = self.check_state(state)
        self.epoch = state["epoch"]
        self._resume_at, self._live = position, False

    def check_state(self, state: Any) -> int:
        """The position ``state`` resumes at; ValueError when it is not a state of a sampler with
        this one's seed, shuffle, drop_last and dataset length (the order would differ)."""
        if not isinstance(state, dict) or state.get(_MARKER) != _VERSION:
            raise ValueError(f"not a ResumableDistributedSampler state (version {_VERSION}): {_short(state)}")
        for key in ("position", "epoch", "seed", "dataset_len"):
            value = state.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or (key != "seed" and value < 0):
                raise ValueError(f"sampler state: {key} is {value!r}, not a non-negative int")
        for key in ("shuffle", "drop_last"):
            if not isinstance(state.get(key), bool):
                raise ValueError(f"sampler state: {key} is {state.get(key)!r}, not a bool")
        live = {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last, "dataset_len": len(self.dataset)}
        for key, value in live.items():
            if state[key] != value:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r}, this sampler has {key}={value!r}: "
                    "the epoch's order would differ"
                )
        if state["position"] > state["dataset_len"]:
            raise ValueError(f"sampler state: position {state['position']} is past the dataset ({state['dataset_len']})")
        position: int = state["position"]
        return position


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sampler_states(state: Any, _depth: int = 0) -> list[dict[str, Any]]:
    """Every :class:`ResumableDistributedSampler` state nested in a (decoded) dataloader state."""
    if _depth > 32:
        return []
    if isinstance(state, dict):
        if _MARKER in state:
            return [state]
        return [s for v in state.values() for s in sampler_states(v, _depth + 1)]
    if isinstance(state, (list, tuple)):
        return [s for v in state for s in sampler_states(v, _depth + 1)]
    return []


def _steps_behind(state: Any, _depth: int = 0) -> int:
    """Batches a StatefulDataLoader with workers returned after its last snapshot (then the sampler
    state in the snapshot lags them: ``snapshot_every_n_steps`` above 1)."""
    if not isinstance(state, dict) or _depth > 32:
        return 0
    behind = state.get("_steps_since_snapshot")
    own = behind if isinstance(behind, int) and not isinstance(behind, bool) else 0
    return max([own, *(_steps_behind(v, _depth + 1) for v in state.values())])


def find_sampler(loader: Any) -> ResumableDistributedSampler | None:
    """The sampler a dataloader draws from (``.sampler``, ``.batch_sampler.sampler``, or itself)."""
    if isinstance(loader, ResumableDistributedSampler):
        return loader
    for attr in ("sampler", "batch_sampler"):
        candidate = getattr(loader, attr, None)
        if isinstance(candidate, ResumableDistributedSampler):
            return candidate
        inner = getattr(candidate, "sampler", None)
        if isinstance(inner, ResumableDistributedSampler):
            return inner
    return None


def restart_loader(loader: Any, sampler: ResumableDistributedSampler, state: dict[str, Any]) -> None:
    """Set a resharded position: the sampler resumes at it, the loader starts a fresh iteration
    (a ``StatefulDataLoader``'s own counters and worker states begin anew)."""
    sampler.load_state_dict(state)
    if loader is sampler:
        return
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # pragma: no cover - the data extra
        return
    if isinstance(loader, StatefulDataLoader):
        loader.load_state_dict({})  # drops an iterator made before this load, and nothing else


# -- resharding the per-rank state ---------------------------------------------------------------


def reshard_per_rank_state(
    *,
    path: Path,
    affected: list[str],
    saved_world_size: int,
    rank: int,
    world_size: int,
    read: Callable[[Path, int], dict[str, Any] | None],
) -> dict[str, Any]:
    """This rank's per-rank state at a new world size: the saved ranks' agreed data position
    (``RESHARD_KEY``) and RNG derived by :func:`derived_rng_state`, as encoded JSON."""
    out: dict[str, Any] = {}
    first = _decoded(path, 0, read)
    if DATALOADER in affected:
        # rank 0 reads every saved rank's state to check they agree (the load's vote brings its verdict
        # to every rank); the others take rank 0's: every rank reading all of them was ranks squared reads
        ranks = saved_world_size if rank == 0 else 1
        out[RESHARD_KEY] = encode(_agreed_position(path, first, saved_world_size, world_size, read, ranks=ranks))
    if RNG in affected:
        rng = first.get(RNG)
        try:
            check_rng(rng)
            assert isinstance(rng, dict)  # check_rng: a dict with its python and torch parts
            derived = derived_rng_state(rng, rank=rank, world_size=world_size)
        except (ValueError, TypeError, KeyError, struct.error) as exc:
            raise CheckpointCorruptError(f"{path}: rank 0's RNG state is damaged ({exc})") from exc
        out[RNG] = encode(derived)
    return out


def _decoded(path: Path, rank: int, read: Callable[[Path, int], dict[str, Any] | None]) -> dict[str, Any]:
    raw = read(path, rank)
    if raw is None:
        raise CheckpointCorruptError(f"{path}: the per-rank state of saved rank {rank} is missing")
    try:
        data = decode(raw)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{path}: damaged per-rank state of rank {rank} ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path}: damaged per-rank state of rank {rank}")
    return data


def _agreed_position(
    path: Path,
    first: dict[str, Any],
    saved_world_size: int,
    world_size: int,
    read: Callable[[Path, int], dict[str, Any] | None],
    *,
    ranks: int,
) -> dict[str, Any]:
    """The one sampler state every saved rank holds (of the first ``ranks`` saved ranks, those it
    reads); else CheckpointMismatchError saying why."""
    agreed: dict[str, Any] | None = None
    for r in range(ranks):
        data = first if r == 0 else _decoded(path, r, read)
        states = sampler_states(data.get(DATALOADER))
        if not states:
            raise CheckpointMismatchError(
                f"{path} was saved by {saved_world_size} rank(s) and is being loaded by {world_size}: rank {r}'s "
                "dataloader state holds no ResumableDistributedSampler position, so "
                "on_world_size_change='reshard' cannot map it onto the new ranks (only map-style datasets "
                "sampled by checkpoint_manager.ResumableDistributedSampler, under a StatefulDataLoader, "
                "reshard; an iterable dataset's per-rank position cannot). Set "
                "on_world_size_change='restart_per_rank_state' to start the data order fresh, or pass "
                "LoadContext(load_dataloader=False)"
            )
        behind = _steps_behind(data.get(DATALOADER))
        if behind:
            raise CheckpointMismatchError(
                f"{path}: rank {r}'s StatefulDataLoader returned {behind} batch(es) after its last snapshot "
                "(snapshot_every_n_steps > 1), so the sampler position it saved lags the data consumed and "
                "cannot be resharded; save with snapshot_every_n_steps=1 (the default)"
            )
        for state in states:
            if agreed is None:
                agreed = state
            elif state != agreed:
                raise CheckpointMismatchError(
                    f"{path}: the saved ranks disagree on the data position (rank 0: {_where(agreed)}; "
                    f"rank {r}: {_where(state)}): they did not consume the same number of samples, so "
                    "there is no global position to resume at another world size"
                )
    assert agreed is not None
    return agreed


def _where(state: dict[str, Any]) -> str:
    fields = ", ".join(f"{k} {state.get(k)!r}" for k in ("position", *_FIELDS))
    return fields


def derived_rng_state(saved: dict[str, Any], *, rank: int, world_size: int) -> dict[str, Any]:
    """The RNG state of new rank ``rank`` of ``world_size`` when resharding, from saved rank 0's.

    ``d = SHA-256(domain, world_size, rank, torch state bytes, Python MT words, NumPy MT words)``
    (integers as little-endian 64-bit, MT words as 32-bit); then Python's ``random`` is seeded with
    ``d`` as a 256-bit integer, torch's CPU generator with ``d[0:8]``, NumPy's legacy global
    generator with the four 32-bit words ``d[8:24]``, and each CUDA device's with ``d[24:32]``.
    """
    h = hashlib.sha256(_RNG_DOMAIN)
    h.update(struct.pack("<QQ", world_size, rank))
    torch_state = saved["torch"]
    if not isinstance(torch_state, torch.Tensor):
        raise TypeError("the torch RNG state is not a tensor")
    h.update(torch_state.contiguous().numpy().tobytes())
    python = saved["python"]
    words = list(python[1])
    h.update(struct.pack(f"<{len(words)}I", *words))
    if np is not None and "numpy" in saved:
        _, keys, pos, *_rest = saved["numpy"]
        h.update(np.asarray(keys, dtype="<u4").tobytes())
        h.update(struct.pack("<Q", int(pos)))
    d = h.digest()
    state: dict[str, Any] = {
        "python": random.Random(int.from_bytes(d, "little")).getstate(),
        "torch": torch.Generator().manual_seed(int.from_bytes(d[0:8], "little")).get_state(),
    }
    if np is not None:
        state["numpy"] = np.random.RandomState(np.frombuffer(d[8:24], dtype="<u4")).get_state()
    if "cuda" in saved and torch.cuda.is_available():
        seed = int.from_bytes(d[24:32], "little")
        state["cuda"] = [
            torch.Generator(device=f"cuda:{i}").manual_seed(seed).get_state() for i in range(torch.cuda.device_count())
        ]
    return state
