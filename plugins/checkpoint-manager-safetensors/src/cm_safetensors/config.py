"""The engine's own setting, validated by the same config object as the core's."""

from __future__ import annotations

from pydantic import Field, field_validator

from checkpoint_manager import CheckpointConfig

__all__ = ["SafetensorsConfig", "check_filename"]


def check_filename(value: str) -> str:
    """``value`` if it is a plain per-rank file name (``'{rank}'`` in it, ending in .safetensors, no
    directory part); else ValueError. The one rule for the config and for a name read from a checkpoint."""
    try:
        plain = isinstance(value, str) and value.format(rank=0) != value
    except (KeyError, IndexError, ValueError, AttributeError):
        plain = False
    if not plain or not value.endswith(".safetensors") or "/" in value or "\\" in value or value.startswith("."):
        raise ValueError(f"filename must be a plain file name with '{{rank}}' ending in .safetensors, got {value!r}")
    return value


class SafetensorsConfig(CheckpointConfig):
    """:class:`CheckpointConfig` plus the name of each rank's tensor file."""

    engine: str = Field(default="safetensors", description="The engine that writes the bytes.")
    filename: str = Field(
        default="state_{rank}.safetensors",
        description="Name of each rank's tensor file inside a checkpoint; '{rank}' is the rank.",
    )

    @field_validator("filename")
    @classmethod
    def _plain_file_name(cls, value: str) -> str:
        return check_filename(value)
