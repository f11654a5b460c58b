"""``--module cm_torchtitan --config <name>``: any of torchtitan's config functions, with this backend.

``<name>`` is a config function of torchtitan's model registries (``llama3_debugmodel``,
``qwen3_...``), found in the module its name starts with, or spelled ``<module>.<function>``; the
trainer config it returns gets :class:`~cm_torchtitan.TorchTitanCheckpointManager.Config` in place of
the DCP backend's, every torchtitan checkpoint field kept. ``--checkpoint.<field>`` then sets ours
too (``--checkpoint.keep_best 3``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torchtitan.config import derive

from cm_torchtitan.manager import TorchTitanCheckpointManager

__all__ = ["find_config_function", "with_checkpoint_manager"]


def with_checkpoint_manager(config: Any, **fields: Any) -> Any:
    """``config`` (a ``Trainer.Config``) with its checkpointer switched to this backend, ``fields`` set."""
    config.checkpoint = derive(config.checkpoint, TorchTitanCheckpointManager.Config, **fields)
    return config


def _registries() -> list[str]:
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    models = [f"torchtitan.models.{m}.config_registry" for m in sorted(_supported_models)]
    return models + [f"torchtitan.experiments.{m}.config_registry" for m in sorted(_supported_experiments)]


def find_config_function(name: str) -> Callable[[], Any]:
    """torchtitan's config function ``name`` (``llama3_debugmodel``, or ``llama3.llama3_debugmodel``)."""
    module_hint, _, function = name.rpartition(".")
    registries = _registries()
    if module_hint:
        candidates = [r for r in registries if r.split(".")[-2] == module_hint]
    else:  # the registry named like the function's prefix first (the rest imports every model)
        prefixed = [r for r in registries if function.startswith(r.split(".")[-2])]
        candidates = sorted(prefixed, key=lambda r: -len(r)) + [r for r in registries if r not in prefixed]
    for registry in candidates:
        try:
            module = importlib.import_module(registry)
        except ImportError:
            continue
        fn = getattr(module, function, None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    raise AttributeError(f"no torchtitan config function {name!r} (looked in {', '.join(candidates) or 'nothing'})")


def __getattr__(name: str) -> Callable[[], Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    source = find_config_function(name)

    def config() -> Any:
        return with_checkpoint_manager(source())

    config.__name__ = config.__qualname__ = name.rpartition(".")[2]
    config.__doc__ = f"{name}, checkpointed by checkpoint-manager."
    return config
