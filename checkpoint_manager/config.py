"""The configuration of checkpointing: one validated object, loadable from dict, JSON or YAML."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CheckpointConfig", "LoadMode"]

LoadMode = Literal["auto", "required", "never"]

_C = TypeVar("_C", bound="CheckpointConfig")


class CheckpointConfig(BaseModel):
    """Where checkpoints go, when they are taken, what is kept and which manager does the work.

    Subclass it to add the fields a custom manager needs; ``extra="forbid"`` makes a misspelt field
    an error that names it instead of a setting silently ignored.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    save_dir: str = Field(description="Directory (or fsspec URL) that receives checkpoints.")
    load_dir: str | None = Field(default=None, description="Where to resume from; defaults to save_dir.")
    manager: str | None = Field(
        default=None,
        description="None for the default DCP manager, an entry-point name registered in group "
        "'checkpoint_manager.managers', or a dotted path 'pkg.mod.Class' / 'pkg.mod:Class'.",
    )
    save_every_n_steps: int | None = Field(
        default=None, ge=1, description="Save when step is a multiple of this; None: only forced/final."
    )
    load_mode: LoadMode = Field(
        default="auto",
        description="auto: resume if a committed checkpoint exists; required: error if none; never.",
    )
    load_step: int | None = Field(
        default=None, ge=0, description="Resume from exactly this step instead of the newest."
    )
    initial_load_path: str | None = Field(
        default=None,
        description="Model weights for a fresh start (no checkpoint to resume): a checkpoint directory.",
    )
    async_save: bool = Field(default=False, description="Write in the background after staging.")
    async_when_busy: Literal["wait", "skip"] = Field(
        default="wait",
        description="When a save is due while the previous async save still writes: wait for it, or skip "
        "this one with a warning.",
    )
    save_on_preemption: bool = Field(
        default=False,
        description="On SIGTERM, the next save() saves whatever the interval and blocks until committed; "
        "manager.preempted then tells the loop to exit.",
    )
    name_template: str = Field(
        default="step_{step:08d}",
        description="Directory name of a checkpoint; may use step, epoch, consumed_samples, metrics.",
    )
    fsync: bool = Field(
        default=True, description="fsync files and directories before commit (turn off only for tests)."
    )
    sweep_pending_on_start: bool = Field(
        default=True, description="Remove leftovers of interrupted saves when the manager starts."
    )

    @model_validator(mode="after")
    def _check_paths(self) -> CheckpointConfig:
        if not self.save_dir.strip():
            raise ValueError("save_dir must not be empty")
        return self

    @property
    def resolved_load_dir(self) -> str:
        """The directory resumes read from."""
        return self.load_dir if self.load_dir is not None else self.save_dir

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        """Validate a plain dict (e.g. one section of a larger config)."""
        return cls.model_validate(data)

    @classmethod
    def from_file(cls: type[_C], path: str | Path) -> _C:
        """Load from a ``.json``, ``.yaml`` or ``.yml`` file."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        suffix = path.suffix.lower()
        if suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ImportError(
                    f"reading {path} needs PyYAML: pip install 'checkpoint-manager[yaml]'"
                ) from exc
            data = yaml.safe_load(text)
        else:
            raise ValueError(f"{path}: unsupported config file type {suffix!r} (use .json, .yaml or .yml)")
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        return cls.model_validate(data)
