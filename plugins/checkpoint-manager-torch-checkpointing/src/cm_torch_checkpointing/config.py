"""The plugin's settings: the core config plus the engine's own knobs, validated in one object."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from checkpoint_manager import CheckpointConfig

__all__ = ["SUPPORTED_BASE_FIELDS", "TorchCheckpointingConfig"]

#: The core fields this manager honours; any other core field set to a non-default value is refused,
#: so a setting is never silently ignored.
SUPPORTED_BASE_FIELDS = frozenset(
    {
        "save_dir",
        "load_dir",
        "manager",
        "save_every_n_steps",
        "save_every_n_seconds",
        "save_at_steps",
        "final_step",
        "save_policy",
        "load_mode",
        "load_step",
        "async_save",
        "async_when_busy",
        "fsync",
        "direct_io",
        "verify_on_load",
        "sweep_pending_on_start",
        "keep_last",
        "keep_every_n_steps",
        "collective_timeout_s",
        "event_log",
    }
)


class TorchCheckpointingConfig(CheckpointConfig):
    """:class:`CheckpointConfig` plus how the torch_checkpointing engine runs async saves."""

    async_engine: Literal["thread", "process"] = Field(
        default="thread",
        description="How async saves write: 'thread' copies the state into reused host buffers and runs "
        "the engine's writer on a background thread; 'process' uses torch_checkpointing's own async "
        "saver (staging plus a spawned writer process, which takes seconds to start on the first save; "
        "single-process runs only).",
    )
    engine_direct_io: bool = Field(
        default=False,
        description="Let the engine open files with O_DIRECT. Off by default: on ext4 its O_DIRECT "
        "writes fail with EINVAL at close. (The core's direct_io applies to the DCP writer only.)",
    )
    engine_timeout_s: int = Field(
        default=600, ge=1, description="Bound on the engine's waits for staging and writing."
    )

    @field_validator("save_dir", "load_dir")
    @classmethod
    def _local_only(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            raise ValueError(f"the torch-checkpointing manager writes to local directories only, got {value!r}")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> TorchCheckpointingConfig:
        for name, field in CheckpointConfig.model_fields.items():
            if name in SUPPORTED_BASE_FIELDS:
                continue
            value = getattr(self, name)
            if value != field.get_default(call_default_factory=True):
                raise ValueError(
                    f"the torch-checkpointing manager does not support {name}={value!r}; leave it at its "
                    f"default or use the default manager (it supports: {', '.join(sorted(SUPPORTED_BASE_FIELDS))})"
                )
        if self.verify_on_load == "full":
            raise ValueError(
                "the torch-checkpointing manager records file sizes, not checksums: "
                "verify_on_load must be 'off' or 'sizes', got 'full'"
            )
        return self
