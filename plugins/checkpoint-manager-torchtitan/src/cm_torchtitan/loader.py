"""torchtitan's data loader position, without pickle.

``ParallelAwareDataloader.state_dict()`` wraps the ``StatefulDataLoader`` state in
``pickle.dumps`` bytes and its ``load_state_dict`` unpickles whatever bytes it is given, so handing
the loader itself to a checkpoint would write a pickle and, on load, run one from a file.
:class:`LoaderState` saves the underlying ``StatefulDataLoader`` state as plain data (the library
stores it as JSON, per rank) and restores it the same way, checking the data-parallel degree as
torchtitan does.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import CheckpointMismatchError, UnsafeCheckpointError

__all__ = ["LoaderState", "loads_plain_data"]

_WORLD = "dp_world_size"
_STATE = "loader"


class LoaderState:
    """The position of a torchtitan data loader, as a ``Stateful`` that holds no pickle.

    A loader that is a ``StatefulDataLoader`` (torchtitan's ``ParallelAwareDataloader`` and its
    subclasses) is saved through ``StatefulDataLoader``'s own ``state_dict``; any other
    ``BaseDataLoader`` through its ``state_dict``, which must then hold plain data.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @property
    def dp_world_size(self) -> int | None:
        size = getattr(self.loader, "dp_world_size", None)
        return size if isinstance(size, int) else None

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.loader, StatefulDataLoader):
            return {_WORLD: self.dp_world_size, _STATE: StatefulDataLoader.state_dict(self.loader)}
        state: dict[str, Any] = self.loader.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(self.loader, StatefulDataLoader):
            self.loader.load_state_dict(state_dict)
            return
        if _STATE not in state_dict:
            raise CheckpointMismatchError(
                f"the saved data loader state holds {sorted(state_dict)}, not a StatefulDataLoader position"
            )
        self._check_world(state_dict.get(_WORLD))
        StatefulDataLoader.load_state_dict(self.loader, state_dict[_STATE])

    def from_torchtitan(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """What :meth:`load_state_dict` takes, from torchtitan's own layout (``{"dp_rank_<r>": pickle
        bytes, "world_size": n}``), the bytes read as plain data only (:func:`loads_plain_data`)."""
        rank_key = f"dp_rank_{getattr(self.loader, 'dp_rank', 0)}"
        if rank_key not in state_dict:
            raise CheckpointMismatchError(f"torchtitan's data loader state has no {rank_key!r} entry")
        raw = state_dict[rank_key]
        if not isinstance(raw, bytes):
            raise CheckpointMismatchError(f"torchtitan's data loader state {rank_key!r} is a {type(raw).__name__}, not bytes")
        self._check_world(state_dict.get("world_size"))
        return {_WORLD: state_dict.get("world_size"), _STATE: loads_plain_data(raw, rank_key)}

    def _check_world(self, saved: Any) -> None:
        if saved is not None and self.dp_world_size is not None and saved != self.dp_world_size:
            raise CheckpointMismatchError(
                f"the data loader was saved at data-parallel degree {saved} and is loaded at "
                f"{self.dp_world_size}: torchtitan's loaders cannot reshard their position; pass "
                "exclude_from_loading=['dataloader'] to start the data order fresh"
            )


class _PlainData(pickle.Unpickler):
    """Unpickles containers, numbers, strings and bytes; refuses every global (so every callable)."""

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(
            f"{self._source}: refuses to load global {module}.{name}: only plain data (dicts, lists, "
            "numbers, strings, bytes) is read from torchtitan's pickled data loader state"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source}: refuses a persistent reference in pickled data")


def loads_plain_data(data: bytes, source: str) -> Any:
    """The value of a pickle that holds plain data only; :class:`UnsafeCheckpointError` when it
    names any class or function (no code from the file ever runs)."""
    return _PlainData(data, source).load()
