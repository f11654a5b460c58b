"""checkpoint-manager-safetensors: an example engine, each rank's tensors in one safetensors file.

Registered as the engine ``safetensors`` (entry-point group ``checkpoint_manager.engines``):
``CheckpointConfig(save_dir=..., engine="safetensors")``.
"""

from typing import Any

from cm_safetensors.config import SafetensorsConfig
from cm_safetensors.engine import FORMAT, SafetensorsEngine

__version__ = "0.2.0"

__all__ = ["FORMAT", "SafetensorsConfig", "SafetensorsEngine", "__version__"]


def __getattr__(name: str) -> Any:
    """``SafetensorsManager``, deprecated: the default manager with ``engine="safetensors"``."""
    if name == "SafetensorsManager":
        from cm_safetensors._deprecated import SafetensorsManager, warn

        warn()
        return SafetensorsManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
