"""The fields of :class:`~checkpoint_manager.config.CheckpointConfig`, one base model per group.

Each group carries the validators of its own fields; checks that span groups live on
``CheckpointConfig`` itself. ``CheckpointConfig`` lists the groups in reverse, because pydantic
orders fields from the deepest base up: the fields keep the order (and the JSON schema) of one
class that declares them top to bottom.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_serializer, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from checkpoint_manager.core.deprecation import warn_deprecated
from checkpoint_manager.core.naming import validate_template
from checkpoint_manager.storage.remote import deprecated_spellings

__all__ = ["MAX_COLLECTIVE_TIMEOUT_S", "LoadMode", "MonitorMode", "SaveCallable"]

LoadMode = Literal["auto", "required", "never"]
MonitorMode = Literal["min", "max"]
#: ``(step, last_saved_step) -> bool``: a user's own "save now?" rule, OR-ed with the others.
SaveCallable = Callable[[int, "int | None"], bool]

# A bound that every layer below accepts (gloo keeps timeouts in milliseconds); ~116 days is "never".
MAX_COLLECTIVE_TIMEOUT_S = 10_000_000.0


class RunFields(BaseModel):
    """Where checkpoints go, which manager and engine do the work, how loads and saves behave."""

    save_dir: str = Field(description="Directory (or fsspec URL) that receives checkpoints.")
    load_dir: str | None = Field(default=None, description="Where to resume from; defaults to save_dir.")
    manager: str | None = Field(
        default=None,
        description="None for the default DCP manager, an entry-point name registered in group "
        "'checkpoint_manager.managers', or a dotted path 'pkg.mod.Class' / 'pkg.mod:Class'.",
    )
    engine: str = Field(
        default="dcp",
        description="The Engine that writes and reads a checkpoint's files: 'dcp' (built in: "
        "torch.distributed.checkpoint), an entry-point name registered in group "
        "'checkpoint_manager.engines', or a dotted path 'pkg.mod.Class' / 'pkg.mod:Class'.",
    )
    on_unsupported_field: Literal["warn", "error"] = Field(
        default="warn",
        description="What setting a field that the chosen manager declares it does not implement "
        "(its unsupported_config_fields) does: warn (UnsupportedConfigWarning) or error (ValueError).",
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
        description="Model weights for a fresh start (no checkpoint to resume): a checkpoint directory, "
        "a bundle (.tar) or a Hugging Face directory / .safetensors file.",
    )
    async_save: bool = Field(default=False, description="Write in the background after staging.")
    async_overlap: bool = Field(
        default=False,
        description="Start writing each large staged tensor while the rest is still being copied: the "
        "async total drops by about one memcpy, the stall grows (the copy and the writes share memory "
        "bandwidth and the two cores). Local save_dir only.",
    )
    save_frozen: Literal["every", "once"] = Field(
        default="every",
        description="once: model parameters that do not require grad (a frozen base, frozen towers) are "
        "written by the first checkpoint that needs them and shared by later ones while their contents "
        "(CRC-32, checked at every save) are unchanged: hard links on a local disk, server-side copies "
        "in an object store. Every checkpoint stays complete and loads alone. every: each checkpoint "
        "writes them.",
    )
    check_finite: bool = Field(
        default=False,
        description="Refuse to commit a checkpoint whose model weights, buffers or extras' tensors hold "
        "NaN or inf (NonFiniteStateError naming them; checked beside the write, so it costs little), and "
        "check the same before a load sets them (auto-resume skips a non-finite checkpoint).",
    )
    check_finite_optimizer: bool = Field(
        default=False,
        description="With check_finite: check the optimizer state too.",
    )
    on_save_error: Literal["raise", "continue"] = Field(
        default="raise",
        description="raise: a failed save raises into the training loop. continue: it is cleaned up as "
        "always, logged, reported (event log, on_error, SaveResult.error, manager.last_save_error) and "
        "training goes on; the max_consecutive_save_failures-th failure in a row raises, and a final or "
        "preemption save always does.",
    )
    max_consecutive_save_failures: int = Field(
        default=3,
        ge=1,
        description="With on_save_error='continue': this many failed saves in a row raise the last one.",
    )
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
    direct_io: bool = Field(
        default=True,
        description="Write tensor files with O_DIRECT through aligned buffers (bypassing the page cache, "
        "several times faster on most disks); falls back to buffered writes where refused.",
    )
    verify_on_load: Literal["off", "sizes", "full"] = Field(
        default="sizes",
        description="Before loading, check every file's size and the CRC32 of the small files read whole "
        "(sizes), or every file's CRC32 (full); see docs/integrity.md.",
    )
    sweep_pending_on_start: bool = Field(
        default=True,
        description="Remove leftovers of interrupted saves when the manager starts (only a manager that "
        "holds the writer lock does; saves this process is writing are never touched).",
    )

    @field_validator("save_dir", "load_dir")
    @classmethod
    def _check_dirs(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} must not be empty")
        return value

    @field_validator("name_template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        validate_template(value)
        return value


class CadenceFields(BaseModel):
    """When to save: a save happens when any of these (or ``save_every_n_steps``) says so."""

    save_every_n_seconds: float | Literal["auto"] | None = Field(
        default=None,
        description="Save when this many seconds of wall clock passed since the last save; 'auto': the "
        "Young-Daly interval sqrt(2 * cost * MTBF) from the measured cost of this run's saves and "
        "mtbf_hours (see docs/policies.md).",
    )
    mtbf_hours: float | None = Field(
        default=None,
        gt=0,
        description="Mean time between failures of the whole job, in hours; needed by "
        "save_every_n_seconds='auto'.",
    )
    save_continuously: bool = Field(
        default=False,
        description="Save at the first step after the previous save became durable (an async save "
        "committed; every step for sync saves), at most every min_save_interval_s.",
    )
    min_save_interval_s: float = Field(
        default=0.0,
        ge=0,
        description="Lower bound of the interval chosen by save_every_n_seconds='auto' and of the gap "
        "between two saves of save_continuously.",
    )
    max_save_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="Upper bound of the interval chosen by save_every_n_seconds='auto' (None: unbounded).",
    )
    save_at_steps: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="Save at exactly these steps (e.g. before a planned learning-rate change)."
    )
    final_step: int | None = Field(
        default=None, ge=0, description="The last step of training: always saved (as is SaveContext(final=True))."
    )
    save_policy: SkipJsonSchema[SaveCallable | None] = Field(
        default=None,
        exclude=True,
        description="Your own rule, called as save_policy(step, last_saved_step) -> bool on rank 0; "
        "code, so never serialized.",
    )

    @field_validator("save_every_n_seconds", mode="before")
    @classmethod
    def _check_seconds(cls, value: Any) -> Any:
        """One error for a bad value (not one per member of the float | 'auto' union)."""
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PydanticCustomError(
                "seconds_or_auto", "Input should be a number of seconds or 'auto'"
            )
        if not math.isfinite(value):
            raise PydanticCustomError("finite_number", "Input should be a finite number")
        if value <= 0:
            raise PydanticCustomError("greater_than", "Input should be greater than 0")
        return value


class RetentionFields(BaseModel):
    """What to keep: a checkpoint survives if any rule keeps it; the newest, the best, the one resumed
    from, saves in flight and superseded checkpoints are always kept, and a damaged one is replaced
    by the next intact one. Nothing set: keep everything."""

    keep_last: int | None = Field(
        default=None,
        ge=1,
        description="Keep the newest N checkpoints (None, the default, with no other keep_* rule: keep every one).",
    )
    keep_best: int | None = Field(
        default=None, ge=1, description="Keep the N best checkpoints by `monitor` (needs `monitor`)."
    )
    monitor: str | None = Field(
        default=None,
        description="The metric (a key of SaveContext.metrics) that ranks checkpoints and names `best`.",
    )
    mode: MonitorMode = Field(default="min", description="Whether a lower (min) or higher (max) `monitor` is better.")
    keep_unranked: bool = Field(
        default=False,
        description="Keep checkpoints whose `monitor` is missing or NaN (they never rank); False lets "
        "the other rules decide.",
    )
    keep_every_n_steps: int | None = Field(
        default=None, ge=1, description="Keep every checkpoint whose step is a multiple of N, forever."
    )
    delete_superseded: bool = Field(
        default=False,
        description="Let retention delete superseded checkpoints (those a run abandoned by going back to "
        "an older one and saving); False keeps them, listed as superseded and loadable by path.",
    )
    background_deletion: bool = Field(
        default=True,
        description="Free the disk of pruned checkpoints on a background thread (they vanish from the "
        "listing at once either way).",
    )


class LockFields(BaseModel):
    """Pointers and the writer lock."""

    pointer_symlinks: bool = Field(
        default=False,
        description="Also keep relative symlinks latest_checkpoint / best_checkpoint for people browsing.",
    )
    writer_lock: bool = Field(
        default=True,
        description="Take a lock in save_dir so a second run writing the same directory fails fast; "
        "a manager without it never sweeps nor prunes.",
    )
    lock_stale_after_s: float | None = Field(
        default=None,
        gt=0,
        description="Treat a lock held from another host as stale when its heartbeat is older than this "
        "(None: only locks of dead processes on this host are stale).",
    )


class StorageFields(BaseModel):
    """Object storage: ``save_dir`` / ``load_dir`` as fsspec URLs (see docs/object-storage.md)."""

    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        repr=False,
        exclude=True,
        description="Options for fsspec when save_dir/load_dir is a URL (credentials, "
        "client_kwargs={'endpoint_url': ...}); may hold secrets, so never logged, shown in repr or "
        "serialized (model_dump, bundles): give it again when rebuilding a config.",
    )
    scratch_dir: str | None = Field(
        default=None,
        description="Local directory for object-store transfers: saves are written here before they are "
        "uploaded (upload_mode='scratch') and loads download here; None: a directory in the system temp "
        "dir, one per save_dir. Deprecated name: staging_dir.",
    )
    upload_mode: Literal["scratch", "stream"] = Field(
        default="scratch",
        description="Object stores only. scratch: write to scratch_dir with the fast local writer, then "
        "upload; stream: tensor files go straight from memory to the store (no local copy). Deprecated "
        "value: staged (scratch).",
    )
    storage_retries: int = Field(
        default=4,
        ge=0,
        le=100,
        description="Retries of an object-store request that failed transiently (5xx, throttling, "
        "timeouts, dropped connections); permanent errors (403, no such bucket) are never retried.",
    )
    storage_retry_backoff_s: float = Field(
        default=0.5,
        ge=0,
        le=600,
        description="First wait before retrying an object-store request; doubles per retry (with jitter, "
        "capped at 20 s).",
    )

    @field_validator("storage_options")
    @classmethod
    def _check_storage_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if not isinstance(k, str) or not k]
        if bad:
            raise ValueError(f"storage_options keys must be non-empty strings, got {bad!r}")
        return value

    @field_validator("scratch_dir")
    @classmethod
    def _check_scratch_dir(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "://" in value):
            raise ValueError(f"scratch_dir must be a local directory, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _deprecated_spellings(cls, data: Any) -> Any:
        """``staging_dir`` and ``upload_mode="staged"``: accepted as ``scratch_dir`` and ``"scratch"``
        (staging names the host buffers of async saves only), with a DeprecationWarning."""
        if not isinstance(data, dict) or not ("staging_dir" in data or "upload_mode" in data):
            return data
        data = dict(data)
        staging = data.pop("staging_dir", None)
        scratch, mode = deprecated_spellings(data.get("scratch_dir"), staging, data.get("upload_mode", "scratch"))
        if scratch is not None:
            data["scratch_dir"] = scratch
        if "upload_mode" in data:
            data["upload_mode"] = mode
        return data

    @property
    def staging_dir(self) -> str | None:
        """Deprecated name of :attr:`scratch_dir`."""
        warn_deprecated("config field staging_dir is deprecated: read scratch_dir")
        return self.scratch_dir


class DistributedFields(BaseModel):
    """Distributed runs (see docs/distributed.md)."""

    collective_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=MAX_COLLECTIVE_TIMEOUT_S,
        allow_inf_nan=False,
        description="Bound on each checkpoint collective: a dead or hung rank makes the others raise "
        "CollectiveTimeoutError (naming rank and phase) after this long instead of hanging. Must exceed "
        "the largest difference in write time between ranks.",
    )
    on_world_size_change: Literal["error", "restart_per_rank_state", "reshard"] = Field(
        default="error",
        description="Loading at a different world size: model, optimizer, scheduler, extras and train "
        "state reshard; per-rank RNG and dataloader positions need a rule. 'error' refuses to resume while "
        "they are requested; 'restart_per_rank_state' starts them fresh (listed in LoadResult.skipped); "
        "'reshard' resumes the global data position of a ResumableDistributedSampler (no sample of the "
        "epoch skipped or repeated) and derives each new rank's RNG deterministically (docs/data-order.md).",
    )


class FormatFields(BaseModel):
    """Formats: Hugging Face export and initial weights (see docs/formats.md)."""

    save_consolidated: Literal["never", "every", "final"] = Field(
        default="never",
        description="Also write a Hugging Face directory (model*.safetensors + artifacts) into each "
        "checkpoint's 'hf/' before it is committed: never, on every save, or only the final save.",
    )
    consolidated_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="Cast floating-point weights of the consolidated export; None keeps them."
    )
    max_shard_size: int | str = Field(
        default="5GB",
        description="Largest safetensors file of a consolidated export (bytes, or '5GB', '500MiB'); "
        "bigger models are split into model-0000k-of-0000n.safetensors with an index.",
    )
    artifacts_dir: str | None = Field(
        default=None,
        description="Directory whose config, tokenizer and generation-config files are copied into "
        "consolidated exports.",
    )
    initial_load_key_map: SkipJsonSchema[dict[str, str | None] | Callable[[str], str | None] | None] = Field(
        default=None,
        description="Renames the tensors of a Hugging Face initial_load_path to the model's names: prefix "
        "renames {'old.': 'new.'} (None drops) or a function name -> name | None (not serialized).",
    )

    @field_validator("max_shard_size")
    @classmethod
    def _check_shard_size(cls, value: int | str) -> int | str:
        from checkpoint_manager.formats.sizes import parse_size

        parse_size(value)
        return value

    @field_serializer("initial_load_key_map")
    def _serialize_key_map(self, value: Any) -> Any:
        return value if value is None or isinstance(value, dict) else None
