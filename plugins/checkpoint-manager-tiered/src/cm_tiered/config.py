"""The two-tier config: the core fields describe the durable tier, three fields add the local one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from checkpoint_manager import CheckpointConfig

__all__ = ["LOCAL_POLICY_FIELDS", "SHARED_FIELDS", "TieredConfig"]

#: Core fields that say *when* to save: they drive the frequent local tier (the durable tier saves on
#: durable_every_n_steps, save_at_steps, final_step, forced and final saves).
LOCAL_POLICY_FIELDS = frozenset(
    {
        "save_every_n_steps",
        "save_every_n_seconds",
        "save_policy",
        "mtbf_hours",
        "save_continuously",
        "min_save_interval_s",
        "max_save_interval_s",
    }
)

#: Core fields that describe how any checkpoint is written or read: both tiers get them.
SHARED_FIELDS = frozenset(
    {
        "async_save",
        "async_when_busy",
        "save_frozen",
        "name_template",
        "fsync",
        "direct_io",
        "verify_on_load",
        "sweep_pending_on_start",
        "save_at_steps",
        "final_step",
        "background_deletion",
        "delete_superseded",
        "pointer_symlinks",
        "writer_lock",
        "lock_stale_after_s",
        "collective_timeout_s",
        "on_world_size_change",
        "on_save_error",
        "max_consecutive_save_failures",
    }
)

#: Core fields the tiered manager cannot honour: refused at a non-default value, never ignored.
_REFUSED = ("load_dir", "save_on_preemption")


class TieredConfig(CheckpointConfig):
    """``save_dir`` is the durable tier (its retention: keep_last, keep_best, ...); ``local_dir`` the fast one."""

    local_dir: str = Field(
        description="Fast local directory for the frequent checkpoints (a local disk or a RAM-backed "
        "directory such as /dev/shm/run1); it may vanish with the node."
    )
    local_keep_last: int = Field(default=2, ge=1, description="How many checkpoints the local tier keeps.")
    durable_every_n_steps: int | None = Field(
        default=None,
        ge=1,
        description="Also save to the durable tier (save_dir) when the step is a multiple of this; a "
        "multiple of save_every_n_steps when both are set. None: only forced, final and save_at_steps "
        "saves are durable.",
    )

    replicas: int = Field(
        default=0,
        ge=0,
        description="Also hold each rank's local checkpoint on this many ranks of other nodes (peer "
        "replication, see docs/replicas.md): a job that loses a node resumes from the peers' copies "
        "instead of the durable tier. 0: each node's local checkpoints live only there.",
    )

    @field_validator("local_dir")
    @classmethod
    def _local_path(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("local_dir must not be empty")
        if "://" in value:
            raise ValueError(f"local_dir must be a local directory (the fast tier), got the URL {value!r}")
        return value

    @field_validator("local_keep_last", "durable_every_n_steps", "replicas", mode="before")
    @classmethod
    def _no_bools(cls, value: Any, info: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"{info.field_name} must be an integer, not a boolean ({value!r})")
        return value

    @model_validator(mode="after")
    def _check_tiers(self) -> TieredConfig:
        for name in _REFUSED:
            if getattr(self, name) != CheckpointConfig.model_fields[name].get_default():
                raise ValueError(
                    f"the tiered manager does not support {name}={getattr(self, name)!r}: it resumes from "
                    "its own two tiers (local_dir and save_dir)"
                )
        if "://" not in self.save_dir:
            local, durable = Path(self.local_dir).resolve(), Path(self.save_dir).resolve()
            if local == durable or local in durable.parents or durable in local.parents:
                raise ValueError(
                    f"local_dir {self.local_dir!r} and save_dir {self.save_dir!r} must be separate "
                    "directories, neither inside the other (each tier prunes and sweeps its own)"
                )
        every, durable_every = self.save_every_n_steps, self.durable_every_n_steps
        if every is not None and durable_every is not None and durable_every % every:
            raise ValueError(
                f"durable_every_n_steps={durable_every} must be a multiple of save_every_n_steps={every}, "
                "so that every durable checkpoint is one of the local ones (every M-th)"
            )
        return self
