"""The non-tensor values of a state as DCP byte entries, so that plain ``torch.distributed.checkpoint``
reads a whole checkpoint (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``), not only its tensors.

``dcp.save`` stores each non-tensor leaf of a state dict (an optimizer group's ``lr`` and ``betas``,
a scheduler's ``last_epoch``) as a ``torch.save`` record of its own, under the key its flattening
gives (``optim.param_groups.0.lr``), and ``dcp.load`` asks for every such key. We write the same
entries, for the values that ``torch.load(weights_only=True)`` reads back: None, bool, int, float,
str, and lists, tuples and dicts of them. Anything else (numpy arrays, bytes, dtypes, tensors inside
a tuple) is left out, and stays only in ``state.json``. Our own loader never reads these entries: it
takes the values from ``state.json``, so it unpickles nothing new.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from checkpoint_manager.core.checksum import crc32
from checkpoint_manager.engine.dcp.envelope import Envelope, pickle_envelope

__all__ = ["object_records", "plain_entries", "render"]

_ATOMS = frozenset({type(None), bool, int, float, str})


def plain_entries(leaves: Iterable[tuple[str, Any]], tensor_keys: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP byte entries for ``leaves``: the ``(key, value)`` pairs that ``split_tensors`` did not
    turn into tensors, expanded as DCP's flattening expands them (a mapping by its keys, a list that
    holds a tensor or a mapping by its indices; anything else is one entry), values that
    ``torch.load(weights_only=True)`` reads only. ``tensor_keys``: never shadowed by an entry."""
    out: dict[str, Any] = {}
    for key, value in leaves:
        _expand(key, value, out)
    for key in [k for k in out if k in tensor_keys]:
        del out[key]
    return out


def _expand(key: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _expand(f"{key}.{k!s}", v, out)
    elif isinstance(value, torch.Tensor):
        return  # a tensor entry: split_tensors placed it under this very key
    elif isinstance(value, list) and not _terminal(value):
        for i, v in enumerate(value):
            _expand(f"{key}.{i}", v, out)
    elif _plain(value):
        out[key] = value


def _terminal(items: list[Any]) -> bool:
    """torch's ``traverse_state_dict``: a list is one value unless it holds a tensor, a mapping, or
    such a list."""
    if set(map(type, items)) <= _ATOMS:  # in one pass: a group's "params" holds a name per parameter
        return True
    for v in items:
        if isinstance(v, (torch.Tensor, Mapping)):
            return False
        if isinstance(v, list) and not _terminal(v):
            return False
    return True


def _plain(value: Any) -> bool:
    """Made only of what ``torch.load(weights_only=True)`` rebuilds, by exact type (a numpy float is
    a float subclass, and pickles as a numpy object)."""
    kind = type(value)
    if kind in _ATOMS:
        return True
    if kind is list or kind is tuple:
        return set(map(type, value)) <= _ATOMS or all(_plain(v) for v in value)
    if kind is dict:
        return all(type(k) in _ATOMS and _plain(v) for k, v in value.items())
    return False


# torch.save files are built from a template per pickle length (see pickle_envelope), and the last
# records are kept: most values (betas, eps, flags) are the same at every save.
_ENVELOPES: dict[int, Envelope | None] = {}
_RECORDS: dict[bytes, bytes] = {}
_KEEP = 4096


def render(value: Any) -> bytes:
    """``torch.save(value)``'s bytes (for a plain ``value``), built without torch.save's per-call cost."""
    data = pickle.dumps(value, protocol=2)
    record = _RECORDS.get(data)
    if record is not None:
        return record
    size = len(data)
    if size not in _ENVELOPES:
        if len(_ENVELOPES) >= _KEEP:
            _ENVELOPES.clear()
        _ENVELOPES[size] = pickle_envelope(value)
    env = _ENVELOPES[size]
    if env is None:  # a torch that pickles otherwise: its own bytes
        sink = io.BytesIO()
        torch.save(value, sink)
        record = sink.getvalue()
    else:
        record = env.prefix + data + env.render_suffix(crc32(data))
    if len(_RECORDS) >= _KEEP:
        _RECORDS.clear()
    _RECORDS[data] = record
    return record


def object_records(leaves: Iterable[tuple[str, Any]], tensor_keys: Mapping[str, Any]) -> dict[str, bytes]:
    """:func:`plain_entries`, each as the torch.save record DCP stores for it."""
    return {key: render(value) for key, value in plain_entries(leaves, tensor_keys).items()}
