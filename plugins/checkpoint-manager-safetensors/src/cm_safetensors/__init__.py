"""checkpoint-manager-safetensors: the whole state of a small model in one safetensors file + JSON.

Registered as the entry point ``safetensors`` in group ``checkpoint_manager.managers``, so
``CheckpointConfig(save_dir=..., manager="safetensors")`` selects it once this package is installed.
"""

from cm_safetensors.config import SafetensorsConfig
from cm_safetensors.manager import FORMAT, FORMAT_VERSION, META_FILE, SafetensorsManager

__version__ = "0.1.0"

__all__ = ["FORMAT", "FORMAT_VERSION", "META_FILE", "SafetensorsConfig", "SafetensorsManager", "__version__"]
