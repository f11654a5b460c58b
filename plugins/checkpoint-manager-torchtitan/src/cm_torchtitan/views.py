"""The model as the library's lifecycle sees it: one module tree of the live parameters, no hooks.

torchtitan's ``model.state_dict()`` is a derived view (a fused QKV projection is split into
``wq``/``wk``/``wv`` copies by a state-dict hook), so ``torch.distributed.checkpoint``'s state-dict
API cannot map its keys back to parameters. :func:`model_view` mirrors the model parts' module
trees instead, registering the very ``Parameter`` and buffer objects (FSDP2's DTensor shards
included) under their own names: saves read them without copies and loads fill them in place,
resharding, and the optimizer state pairs with them by identity. Several model parts (pipeline
stages) merge into one tree, as torchtitan's ``ModelWrapper`` merges their state dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

__all__ = ["WRAPPER_NAMES", "ParamView", "cast_view", "model_view", "tensor_tree"]

#: Wrapper modules whose single child is the real module (activation checkpointing, torch.compile,
#: FSDP1): skipped, so the names do not change when a run turns them on or off.
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


class ParamView(nn.Module):
    """A node of a view: holds the registered tensors of the module it mirrors, nothing else."""


def _unwrapped(module: nn.Module) -> nn.Module:
    while not module._parameters and len(module._modules) == 1:
        (name, inner), = module._modules.items()
        if name not in WRAPPER_NAMES or inner is None:
            break
        module = inner
    return module


def _mirror(view: nn.Module, module: nn.Module, where: str) -> None:
    module = _unwrapped(module)
    for name, param in module._parameters.items():
        if param is not None:
            _claim(view, name, where)
            view.register_parameter(name, param)
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            _claim(view, name, where)
            view.register_buffer(name, buf)
    for name, child in module._modules.items():
        if child is None:
            continue
        node = view._modules.get(name)
        if node is None:
            node = ParamView()
            view.add_module(name, node)
        _mirror(node, child, f"{where}{name}.")


def _claim(view: nn.Module, name: str, where: str) -> None:
    if name in view._parameters or name in view._buffers:
        raise ValueError(f"two model parts hold a tensor named {where}{name}: parts must not overlap")


def model_view(parts: Iterable[nn.Module]) -> ParamView:
    """One tree of the parts' parameters and persistent buffers (built per call: FSDP2 registers the
    sharded parameters between steps, and those are the ones to save and fill)."""
    view = ParamView()
    for part in parts:
        _mirror(view, part, "")
    return view


def tensor_tree(tensors: Mapping[str, torch.Tensor]) -> ParamView:
    """A module whose state dict is ``tensors`` (dotted names become submodules), as buffers."""
    root = ParamView()
    for key, tensor in tensors.items():
        *path, leaf = key.split(".")
        node: nn.Module = root
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = ParamView()
                node.add_module(part, child)
            node = child
        if leaf in node._buffers or leaf in node._modules:
            raise ValueError(f"tensor name {key!r} collides with another tensor's path")
        node.register_buffer(leaf, tensor)
    return root


def cast_view(view: nn.Module, dtype: torch.dtype, *, convert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ParamView:
    """``view``'s tensors with floating point ones cast to ``dtype`` (copies; others shared)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if convert is not None:
            t = convert(t)
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return tensor_tree({key: cast(t) for key, t in view.state_dict(keep_vars=True).items()})
