"""The configuration of checkpointing: one validated object, loadable from dict, JSON or YAML."""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import InitErrorDetails, PydanticCustomError

from checkpoint_manager.core.naming import validate_template

__all__ = ["CheckpointConfig", "LoadMode", "MonitorMode", "SaveCallable", "did_you_mean", "read_config_file"]

LoadMode = Literal["auto", "required", "never"]
MonitorMode = Literal["min", "max"]
#: ``(step, last_saved_step) -> bool``: a user's own "save now?" rule, OR-ed with the others.
SaveCallable = Callable[[int, "int | None"], bool]

_C = TypeVar("_C", bound="CheckpointConfig")

# A bound that every layer below accepts (gloo keeps timeouts in milliseconds); ~116 days is "never".
MAX_COLLECTIVE_TIMEOUT_S = 10_000_000.0


class CheckpointConfig(BaseModel):
    """Where checkpoints go, when they are taken, what is kept and which manager does the work.

    Subclass it to add the fields a custom manager needs; ``extra="forbid"`` makes a misspelt field
    an error that names it instead of a setting silently ignored.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise explain_validation_error(type(self), exc) from None

    @classmethod
    def model_validate(cls: type[_C], obj: Any, **kwargs: Any) -> _C:
        """As pydantic's, with "did you mean ...?" on misspelt fields."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise explain_validation_error(cls, exc) from None

    save_dir: str = Field(description="Directory (or fsspec URL) that receives checkpoints.")
    load_dir: str | None = Field(default=None, description="Where to resume from; defaults to save_dir.")
    manager: str | None = Field(
        default=None,
        description="None for the default DCP manager, an entry-point name registered in group "
        "'checkpoint_manager.managers', or a dotted path 'pkg.mod.Class' / 'pkg.mod:Class'.",
    )
    engine: str = Field(
        default="dcp",
        description="The engine that writes and reads a checkpoint's files: 'dcp', an entry-point name "
        "registered in group 'checkpoint_manager.engines', or a dotted path 'pkg.mod.Class' / 'pkg.mod:Class'.",
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
    check_finite: bool = Field(
        default=False,
        description="Refuse to commit a checkpoint whose model weights or buffers hold NaN or inf "
        "(NonFiniteStateError naming them); checked beside the write, so it costs little.",
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

    # -- when to save: a save happens when any of these (or save_every_n_steps) says so ------------
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

    # -- what to keep: a checkpoint survives if any rule keeps it; newest, best, the one resumed from
    # -- and saves in flight are always kept. Nothing set: keep everything.
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
    background_deletion: bool = Field(
        default=True,
        description="Free the disk of pruned checkpoints on a background thread (they vanish from the "
        "listing at once either way).",
    )

    # -- pointers and the writer lock -------------------------------------------------------------
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

    # -- object storage: save_dir / load_dir as fsspec URLs (see docs/object-storage.md) --------------
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        repr=False,
        exclude=True,
        description="Options for fsspec when save_dir/load_dir is a URL (credentials, "
        "client_kwargs={'endpoint_url': ...}); may hold secrets, so never logged, shown in repr or "
        "serialized (model_dump, bundles): give it again when rebuilding a config.",
    )
    staging_dir: str | None = Field(
        default=None,
        description="Local directory where object-store saves are staged (and downloads cached) before "
        "upload; None: a directory in the system temp dir, one per save_dir.",
    )
    upload_mode: Literal["staged", "stream"] = Field(
        default="staged",
        description="Object stores only. staged: write to staging_dir with the fast local writer, then "
        "upload; stream: tensor files go straight from memory to the store (no local copy).",
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

    # -- distributed runs (see docs/distributed.md) ---------------------------------------------------
    collective_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=MAX_COLLECTIVE_TIMEOUT_S,
        allow_inf_nan=False,
        description="Bound on each checkpoint collective: a dead or hung rank makes the others raise "
        "CollectiveTimeoutError (naming rank and phase) after this long instead of hanging. Must exceed "
        "the largest difference in write time between ranks.",
    )
    on_world_size_change: Literal["error", "restart_per_rank_state"] = Field(
        default="error",
        description="Loading at a different world size: model, optimizer, scheduler, extras and train "
        "state reshard; per-rank RNG and dataloader positions cannot. 'error' refuses to resume while "
        "they are requested; 'restart_per_rank_state' starts them fresh (listed in LoadResult.skipped).",
    )

    # -- formats: Hugging Face export and initial weights (see docs/formats.md) ------------------------
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

    event_log: bool | str = Field(
        default=False,
        description="Append one JSON line per save, load and error: True writes "
        "<save_dir>/checkpoint_events.jsonl, a string names the file (local paths only).",
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

    @field_validator("save_dir", "load_dir")
    @classmethod
    def _check_dirs(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} must not be empty")
        return value

    @field_validator("storage_options")
    @classmethod
    def _check_storage_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if not isinstance(k, str) or not k]
        if bad:
            raise ValueError(f"storage_options keys must be non-empty strings, got {bad!r}")
        return value

    @field_validator("staging_dir")
    @classmethod
    def _check_staging_dir(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "://" in value):
            raise ValueError(f"staging_dir must be a local directory, got {value!r}")
        return value

    @field_validator(
        "save_every_n_steps", "load_step", "final_step", "keep_last", "keep_best", "keep_every_n_steps",
        "save_at_steps", "storage_retries", "max_consecutive_save_failures", mode="before",
    )
    @classmethod
    def _no_bools(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's ``yes`` is True, which would otherwise pass as the integer 1."""
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, bool) for v in items):
            raise ValueError(f"{info.field_name} must be an integer, not a boolean ({value!r})")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        """Assignments are all-or-nothing: a value that fails any validator leaves the config as it was."""
        if name not in type(self).model_fields:
            try:
                super().__setattr__(name, value)
            except ValidationError as exc:
                raise explain_validation_error(type(self), exc) from None
            return
        before = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
        except ValidationError:
            self.__dict__[name] = before
            raise

    @field_validator("name_template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        validate_template(value)
        return value

    @model_validator(mode="after")
    def _check_retention(self) -> CheckpointConfig:
        if self.monitor is not None and not self.monitor.strip():
            raise ValueError("monitor must be a metric name, not an empty string")
        if self.keep_best is not None and self.monitor is None:
            raise ValueError(
                f"keep_best={self.keep_best} needs monitor: name the metric that ranks checkpoints, "
                "e.g. monitor='val_loss' (and mode='min' or 'max')"
            )
        if self.keep_unranked and self.monitor is None:
            raise ValueError("keep_unranked=True needs monitor: without a metric no checkpoint is ranked")
        return self

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

    @model_validator(mode="after")
    def _check_finite_switches(self) -> CheckpointConfig:
        if self.check_finite_optimizer and not self.check_finite:
            raise ValueError("check_finite_optimizer=True needs check_finite=True")
        return self

    @model_validator(mode="after")
    def _check_cadence(self) -> CheckpointConfig:
        auto = self.save_every_n_seconds == "auto"
        if auto and self.mtbf_hours is None:
            raise ValueError(
                "save_every_n_seconds='auto' needs mtbf_hours: the expected time between failures of the "
                "whole job, e.g. mtbf_hours=4"
            )
        if self.mtbf_hours is not None and not auto:
            raise ValueError("mtbf_hours is only used by save_every_n_seconds='auto'; set that too or drop it")
        if self.max_save_interval_s is not None and self.max_save_interval_s < self.min_save_interval_s:
            raise ValueError(
                f"max_save_interval_s={self.max_save_interval_s:g} is below "
                f"min_save_interval_s={self.min_save_interval_s:g}"
            )
        return self

    @model_validator(mode="after")
    def _check_event_log(self) -> CheckpointConfig:
        if isinstance(self.event_log, str):
            if not self.event_log.strip():
                raise ValueError("event_log must be True, False or a file path, not an empty string")
            if "://" in self.event_log:
                raise ValueError(f"event_log={self.event_log!r}: the event log must be a local file path")
        elif self.event_log and "://" in self.save_dir:
            raise ValueError(
                f"event_log=True writes into save_dir, but {self.save_dir!r} is not a local directory; "
                "give event_log a local file path"
            )
        return self

    @property
    def event_log_path(self) -> str | None:
        """Where the JSON-lines event log goes, or None when it is off."""
        if isinstance(self.event_log, str):
            return self.event_log
        return str(Path(self.save_dir) / "checkpoint_events.jsonl") if self.event_log else None

    @property
    def resolved_load_dir(self) -> str:
        """The directory resumes read from."""
        return self.load_dir if self.load_dir is not None else self.save_dir

    @classmethod
    def from_dict(cls: type[_C], data: dict[str, Any]) -> _C:
        """Validate a plain dict (e.g. one section of a larger config)."""
        return cls.model_validate(data)

    @classmethod
    def from_file(cls: type[_C], path: str | os.PathLike[str]) -> _C:
        """Load from a ``.json``, ``.yaml`` or ``.yml`` file.

        When the file names a ``manager`` whose ``config_class`` extends this class, the file is
        validated as that class, so a custom manager's YAML can carry the manager's own fields.
        """
        from checkpoint_manager.factory import validate_config_for

        return validate_config_for(cls, read_config_file(path))


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a ``.json``, ``.yaml`` or ``.yml`` config file; errors name the file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"{path}: unsupported config file type {suffix!r} (use .json, .yaml or .yml)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path} does not exist") from None
    if suffix == ".json":
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"reading {path} needs PyYAML: pip install 'checkpoint-manager[yaml]'") from exc
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices``, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


_UNKNOWN_FIELD = ("extra_forbidden", "no_such_attribute")


def explain_validation_error(
    cls: type[BaseModel], exc: ValidationError, *, unknown_hint: str = ""
) -> ValidationError:
    """``exc`` with each unknown field's line saying which known field was probably meant.

    ``unknown_hint`` is added to those lines too (e.g. that a manager lacks ``config_class``).
    """
    errors = exc.errors()
    if not any(err["type"] in _UNKNOWN_FIELD for err in errors):
        return exc
    fields = list(cls.model_fields)
    details: list[InitErrorDetails] = []
    for err in errors:
        if err["type"] in _UNKNOWN_FIELD and len(err["loc"]) == 1:
            text = err["msg"] + did_you_mean(str(err["loc"][0]), fields) + unknown_hint
            details.append(
                {"type": PydanticCustomError(err["type"], text), "loc": err["loc"], "input": err["input"]}
            )
        else:
            detail: InitErrorDetails = {"type": err["type"], "loc": err["loc"], "input": err["input"]}
            if "ctx" in err:
                detail["ctx"] = err["ctx"]
            details.append(detail)
    return ValidationError.from_exception_data(exc.title, details)
