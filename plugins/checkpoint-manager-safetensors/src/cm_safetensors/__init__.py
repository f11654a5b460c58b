"""checkpoint-manager-safetensors: an example engine, each rank's tensors in one safetensors file.

Registered as the engine ``safetensors`` (entry-point group ``checkpoint_manager.engines``):
``CheckpointConfig(save_dir=..., engine="safetensors")``. ``manager="safetensors"`` names
:class:`SafetensorsManager`: the default lifecycle, whose config names this engine.
"""

from typing import ClassVar

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager
from cm_safetensors.config import SafetensorsConfig
from cm_safetensors.engine import FORMAT, SafetensorsEngine

__version__ = "0.2.0"

__all__ = ["FORMAT", "SafetensorsConfig", "SafetensorsEngine", "SafetensorsManager", "__version__"]


class SafetensorsManager(DefaultCheckpointManager):
    """``manager="safetensors"``: the default lifecycle, whose config names this engine."""

    config_class: ClassVar[type[CheckpointConfig]] = SafetensorsConfig
