"""The plugin's own settings, validated by the same config object as the core's."""

from __future__ import annotations

from pydantic import Field, field_validator

from checkpoint_manager import CheckpointConfig

__all__ = ["SafetensorsConfig"]

DEFAULT_TEMPLATE = "step_{step:08d}"


class SafetensorsConfig(CheckpointConfig):
    """:class:`CheckpointConfig` plus the file name, retention and RNG switch of this format.

    The base fields this manager cannot honour are refused here, naming the field, rather than
    silently ignored.
    """

    filename: str = Field(
        default="state.safetensors", description="Name of the tensor file inside each checkpoint."
    )
    keep_last: int | None = Field(
        default=None, ge=1, description="Keep only the newest N checkpoints; None keeps all."
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

    @field_validator("async_save")
    @classmethod
    def _sync_only(cls, value: bool) -> bool:
        if value:
            raise ValueError("the safetensors manager saves synchronously; set async_save to false")
        return value

    @field_validator("name_template")
    @classmethod
    def _fixed_names(cls, value: str) -> str:
        if value != DEFAULT_TEMPLATE:
            raise ValueError(f"the safetensors manager names checkpoints {DEFAULT_TEMPLATE!r}; got {value!r}")
        return value

    @field_validator("initial_load_path")
    @classmethod
    def _no_initial_weights(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("the safetensors manager does not support initial_load_path")
        return value
