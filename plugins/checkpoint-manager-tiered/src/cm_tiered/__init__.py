"""checkpoint-manager-tiered: frequent checkpoints to fast local storage, every M-th also durable.

Registered as the entry point ``tiered`` in group ``checkpoint_manager.managers``.
"""

from cm_tiered.config import LOCAL_POLICY_FIELDS, SHARED_FIELDS, TieredConfig
from cm_tiered.manager import TieredCheckpointManager, tier_configs
from cm_tiered.replicas import ReplicationError, ReplicationStats

__version__ = "0.1.0"

__all__ = [
    "LOCAL_POLICY_FIELDS",
    "SHARED_FIELDS",
    "ReplicationError",
    "ReplicationStats",
    "TieredCheckpointManager",
    "TieredConfig",
    "__version__",
    "tier_configs",
]
