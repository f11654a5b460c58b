"""The consolidated export, a phase of its own of a save (:class:`ConsolidatedExport`); and at load,
what a path names (a bundle's unpacked checkpoint) and initial weights from Hugging Face files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint_manager.engine.base import Engine
from checkpoint_manager.engine.reading import open_directory
from checkpoint_manager.errors import CheckpointMismatchError, UnsupportedAdapterError
from checkpoint_manager.formats.hf import HFWeights, check_hf_weights, export_hf, is_hf_weights
from checkpoint_manager.formats.lora import adapter_tensor_names
from checkpoint_manager.formats.model_config import HFConfigRecorder
from checkpoint_manager.formats.resolve import resolve_checkpoint_path
from checkpoint_manager.formats.tensor_groups import model_keys, tensor_entries
from checkpoint_manager.protocol import LoadContext, LoadResult
from checkpoint_manager.state.keys import extra_key

if TYPE_CHECKING:
    from checkpoint_manager.config import CheckpointConfig
    from checkpoint_manager.lifecycle.job import SaveJob

__all__ = [
    "CONSOLIDATED_DIR",
    "ConsolidatedExport",
    "HFConfigRecorder",
    "apply_initial_hf",
    "check_initial_hf",
    "export_consolidated",
    "resolve_load_path",
    "wants_consolidated",
]

log = logging.getLogger("checkpoint_manager")

#: Sub-directory of a checkpoint that holds its Hugging Face export.
CONSOLIDATED_DIR = "hf"


def wants_consolidated(config: CheckpointConfig, *, final: bool) -> bool:
    mode = config.save_consolidated
    return mode == "every" or (mode == "final" and final)


def export_consolidated(
    config: CheckpointConfig, checkpoint_dir: Path, *, final: bool, engine: Engine, meta: Mapping[str, Any]
) -> list[Path]:
    """Per ``save_consolidated``: write ``<checkpoint>/hf`` (``hf/model_0``, ... for lists of models).

    Called by the coordinator on the fully written, not yet committed directory, so the export is
    committed (or discarded) with the checkpoint in the same rename; ``engine`` (the one that wrote it)
    reads it, with ``meta`` standing for the ``checkpoint.json`` to come (``engine``, its record,
    ``world_size``). A PEFT model's LoRA adapter is merged into the base weights (a loadable model);
    an adapter that cannot be merged is not exported (a warning says so) rather than failing the save.
    """
    if not wants_consolidated(config, final=final):
        return []
    t0 = time.perf_counter()
    source = open_directory(checkpoint_dir, config=config, engine=engine, meta=meta)
    keys = model_keys(source.index)
    if not keys:
        log.warning("save_consolidated=%r: %s holds no model to export", config.save_consolidated, checkpoint_dir.name)
        return []
    written: list[Path] = []
    for key in keys:
        out = checkpoint_dir / CONSOLIDATED_DIR if len(keys) == 1 else checkpoint_dir / CONSOLIDATED_DIR / key
        merge = bool(adapter_tensor_names(e.name for e in tensor_entries(source, key)))
        try:
            result = export_hf(
                source,
                out,
                model_key=key,
                max_shard_size=config.max_shard_size,
                dtype=config.consolidated_dtype,
                artifacts_dir=config.artifacts_dir,
                fsync=config.fsync,
                merge_lora=merge,
            )
        except UnsupportedAdapterError as exc:
            log.warning("save_consolidated: not exporting %s of %s (pending): %s", key, checkpoint_dir.name, exc)
            continue
        written.append(result.path)
    if not written:
        return written
    log.info(
        "consolidated export of %s: %s in %.2fs",
        checkpoint_dir.name,
        ", ".join(str(p.relative_to(checkpoint_dir)) for p in written),
        time.perf_counter() - t0,
    )
    return written


class ConsolidatedExport:
    """The export phase of a save (``save_consolidated``): rank 0, into the fully written pending
    directory before ``checkpoint.json`` is described, so the export is committed (or discarded)
    with the checkpoint in the same rename; timed as the save's ``export``."""

    def __init__(self, config: CheckpointConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine

    def run(self, job: SaveJob, header: Mapping[str, Any]) -> None:
        """Export ``job``'s pending directory if the config asks for it at this save; ``header``: the
        ``checkpoint.json`` to come as far as its engine reads it (``engine``, its record, ``world_size``)."""
        t0 = time.perf_counter()
        if export_consolidated(self.config, job.pending, final=job.final, engine=self.engine, meta=header):
            job.timings["export"] = time.perf_counter() - t0


def resolve_load_path(path: Path) -> Path:
    """The checkpoint directory ``path`` names (a bundle: its unpacked copy); Hugging Face weights as is."""
    return path if is_hf_weights(path) else resolve_checkpoint_path(path)


def check_initial_hf(ctx: LoadContext, path: Path, config: CheckpointConfig) -> HFWeights:
    """Initial weights from a Hugging Face directory or ``.safetensors`` file, opened and checked
    against the context's model; the model is set by :func:`apply_initial_hf`."""
    models = ctx.models()
    if len(models) != 1:
        raise CheckpointMismatchError(
            f"{path}: Hugging Face weights load into exactly one model, the context has {len(models)}"
        )
    return check_hf_weights(models[0], path, key_map=config.initial_load_key_map, strict=ctx.strict)


def apply_initial_hf(ctx: LoadContext, weights: HFWeights, t0: float) -> LoadResult:
    """Set the model from checked Hugging Face weights (:func:`check_initial_hf`)."""
    report = weights.apply()
    seconds = time.perf_counter() - t0
    log.info(
        "loaded initial weights from %s: %d tensors in %.2fs%s",
        weights.path,
        len(report.loaded),
        seconds,
        f" (tied, not in the files: {', '.join(report.tied)})" if report.tied else "",
    )
    present = {
        "optim": bool(ctx.optimizers()),
        "scheduler": bool(ctx.schedulers()),
        "dataloader": ctx.dataloader is not None,
        "train_state": ctx.train_state is not None,
    }
    skipped = [name for name, here in present.items() if here] + [extra_key(n) for n in ctx.extra]
    return LoadResult(
        path=str(weights.path), step=0, restored=("model",), skipped=tuple(skipped), bytes=report.bytes, seconds=seconds
    )
