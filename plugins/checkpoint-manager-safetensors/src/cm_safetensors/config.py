"""The plugin's own settings, validated by the same config object as the core's."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from checkpoint_manager import CheckpointConfig

__all__ = ["SUPPORTED_BASE_FIELDS", "SafetensorsConfig"]

#: The core fields this manager honours; any other core field set to a non-default value is refused,
#: so a setting (today's or one the core adds later) is never silently ignored.
SUPPORTED_BASE_FIELDS = frozenset(
    {
        "save_dir",
        "load_dir",
        "manager",
        "save_every_n_steps",
        "load_mode",
        "load_step",
        "fsync",
        "sweep_pending_on_start",
        "keep_last",
    }
)


class SafetensorsConfig(CheckpointConfig):
    """:class:`CheckpointConfig` plus the tensor file name and the RNG switch of this format."""

    filename: str = Field(
        default="state.safetensors", description="Name of the tensor file inside each checkpoint."
    )
    save_rng: bool = Field(default=True, description="Store torch (CPU), random and numpy RNG states.")

    @field_validator("filename")
    @classmethod
    def _plain_file_name(cls, value: str) -> str:
        if not value.endswith(".safetensors") or "/" in value or "\\" in value or value.startswith("."):
            raise ValueError(f"filename must be a plain file name ending in .safetensors, got {value!r}")
        return value

    @field_validator("save_dir", "load_dir")
    @classmethod
    def _local_only(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            raise ValueError(f"the safetensors manager writes to local directories only, got {value!r}")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SafetensorsConfig:
        for name, field in CheckpointConfig.model_fields.items():
            if name in SUPPORTED_BASE_FIELDS:
                continue
            value = getattr(self, name)
            if value != field.get_default(call_default_factory=True):
                raise ValueError(
                    f"the safetensors manager does not support {name}={value!r}; leave it at its default "
                    f"or use the default manager (it supports: {', '.join(sorted(SUPPORTED_BASE_FIELDS))})"
                )
        return self
