"""checkpoint-manager-torchtitan: a torchtitan checkpoint backend driven by checkpoint-manager.

:class:`TorchTitanCheckpointManager` implements torchtitan's ``BaseCheckpointManager``; select it
with ``--module cm_torchtitan --config <torchtitan config>`` or ``--override.imports
cm_torchtitan.override.use_checkpoint_manager`` (see docs/integrations.md, "torchtitan").
"""

from cm_torchtitan.config_registry import with_checkpoint_manager
from cm_torchtitan.loader import LoaderState, loads_plain_data
from cm_torchtitan.manager import TorchTitanCheckpointManager
from cm_torchtitan.titan_dcp import TitanImport, find_titan_steps, load_titan_dcp
from cm_torchtitan.views import ParamView, model_view

__version__ = "0.1.0"

__all__ = [
    "LoaderState",
    "ParamView",
    "TitanImport",
    "TorchTitanCheckpointManager",
    "__version__",
    "find_titan_steps",
    "load_titan_dcp",
    "loads_plain_data",
    "model_view",
    "with_checkpoint_manager",
]
