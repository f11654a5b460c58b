"""The engine's own settings, validated with the core's in one config object."""

from __future__ import annotations

from pydantic import Field

from checkpoint_manager import CheckpointConfig

__all__ = ["TorchCheckpointingConfig"]


class TorchCheckpointingConfig(CheckpointConfig):
    """:class:`CheckpointConfig` plus how torch_checkpointing opens files and how long it waits."""

    engine: str = Field(
        default="torch_checkpointing",
        description="The engine that writes the bytes; this config's manager and engine are torch_checkpointing.",
    )
    engine_direct_io: bool = Field(
        default=False,
        description="Let torch_checkpointing open files with O_DIRECT. Off by default: on ext4 and overlayfs "
        "its O_DIRECT writes fail with EINVAL at close. (The core's direct_io applies to the dcp engine.)",
    )
    engine_timeout_s: int = Field(default=600, ge=1, description="Bound on torch_checkpointing's own waits.")
