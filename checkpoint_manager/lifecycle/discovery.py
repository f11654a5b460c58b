"""Discovery: which checkpoints a save directory holds, and which one a load takes (a path, a step,
the newest intact one with fallback past damaged ones, or the initial weights)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from checkpoint_manager.config import CheckpointConfig
from checkpoint_manager.core.dist import DistContext
from checkpoint_manager.core.layout import CHECKPOINT_JSON, CheckpointInfo, pick_step
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError
from checkpoint_manager.formats.hf import is_hf_weights
from checkpoint_manager.formats.resolve import is_plain_dcp, resolve_checkpoint
from checkpoint_manager.lifecycle.roots import Roots
from checkpoint_manager.protocol import LoadContext
from checkpoint_manager.storage import is_url

__all__ = ["GONE_RETRIES", "Discovery"]

log = logging.getLogger("checkpoint_manager")

GONE_RETRIES = 10  # auto-resume: how many checkpoints may vanish under one load before it gives up (each retry
# takes the newest left, so only a writer that saves faster than a load reads keeps it retrying)


class Discovery:
    """What a manager lists, and which checkpoint its load takes (decided on rank 0, told to every rank)."""

    def __init__(self, config: CheckpointConfig, dist: DistContext, roots: Roots) -> None:
        self.config = config
        self.dist = dist
        self.roots = roots
        self._reported: set[tuple[str, ...]] = set()  # damaged checkpoints already warned about

    def list_checkpoints(self, *, load_dir: bool = False) -> list[CheckpointInfo]:
        """Committed checkpoints in save order, the newest save last, as this process sees them (not
        collective: the manager's own decisions list on rank 0 and share the answer). Those a run
        abandoned by going back to an older checkpoint are listed with ``superseded=True``."""
        storage = self.roots.load if load_dir else self.roots.save
        infos, bad = storage.scan()
        for name, problem in bad:
            self.warn_once(("broken", storage.url, name, problem), "ignoring broken checkpoint %s: %s", name, problem)
        return infos

    def warn_once(self, key: tuple[str, ...], msg: str, *args: object) -> None:
        """Log a problem of a checkpoint on disk the first time this manager meets it: should_load()
        and load() (and every save's retention) look at the same directory again."""
        if key not in self._reported:
            self._reported.add(key)
            log.warning(msg, *args)

    def latest_checkpoint(self, *, load_dir: bool = False) -> CheckpointInfo | None:
        """The newest committed checkpoint of the current line (None: there is none)."""
        line = [i for i in self.list_checkpoints(load_dir=load_dir) if not i.superseded]
        return line[-1] if line else None

    def newest_step(self) -> int | None:
        """The step of save_dir's newest checkpoint of the current line (None: there is none)."""
        latest = self.latest_checkpoint()
        return latest.step if latest else None

    def resolve(self, ctx: LoadContext, skip: Collection[str] = ()) -> tuple[str | None, bool]:
        """The checkpoint to load (or None) and whether it is model-only initial weights; auto-resume
        passes over the locations in ``skip`` (found unloadable by every rank)."""

        def resolve() -> list[Any]:
            path, model_only = self._resolve_local(ctx, skip)
            return [str(path) if path is not None else None, model_only]

        # rank 0 alone lists the directory; every rank gets its answer (or its error)
        answer = self.dist.on_coordinator(resolve, "resolve checkpoint")
        return (str(answer[0]) if answer[0] is not None else None), bool(answer[1])

    def _resolve_local(self, ctx: LoadContext, skip: Collection[str] = ()) -> tuple[str | None, bool]:
        if ctx.path is not None:  # a save directory, a checkpoint, a bundle, plain DCP or a URL
            return self._named(ctx.path, ctx.step), False
        step = ctx.step if ctx.step is not None else self.config.load_step
        if step is not None or self.config.load_mode != "never":
            single = self._load_dir_checkpoint(step)
            if single is not None:
                return single, False
        if step is not None:
            infos = self.list_checkpoints(load_dir=True)
            match = pick_step(infos, step)
            if match is None:
                _, bad = self.roots.load.scan()  # a damaged checkpoint.json hides its step too
                damaged = f"; damaged (step unknown): {', '.join(sorted(n for n, _ in bad))}" if bad else ""
                raise CheckpointNotFoundError(
                    f"no committed checkpoint at step {step} in {self.config.resolved_load_dir}; "
                    f"available steps: {sorted(i.step for i in infos)}{damaged}"
                )
            if match.superseded:
                log.warning("loading %s (step %d), which a later run superseded, as asked", match.location, step)
            return match.location, False
        if self.config.load_mode == "never":
            return None, False
        good = self._newest_intact(skip)
        if good is not None:
            return good.location, False
        if self.config.initial_load_path is not None:
            initial = self.config.initial_load_path
            return (initial if not is_url(initial) and is_hf_weights(Path(initial)) else self._named(initial, None)), True
        if self.config.load_mode == "required":
            raise CheckpointNotFoundError(
                f"load_mode='required' but {self.config.resolved_load_dir} holds no committed checkpoint"
            )
        return None, False

    def _named(self, path: str | Path, step: int | None) -> str:
        """What a path names, by the one rule of :mod:`checkpoint_manager.formats.resolve`: its location
        to load (a bundle stays a bundle: every rank unpacks it in load())."""
        return resolve_checkpoint(
            path,
            step=step,
            storage_options=self.config.storage_options,
            verify_checksum=self.config.verify_on_load != "off",  # as load() reads it
        ).location

    def _load_dir_checkpoint(self, step: int | None) -> str | None:
        """``load_dir`` naming one checkpoint (ours, a bundle, plain DCP) rather than a save directory."""
        load_dir = self.config.load_dir
        if load_dir is None or is_url(load_dir):
            return None
        path = Path(load_dir)
        if path.is_file() or (path / CHECKPOINT_JSON).exists() or is_plain_dcp(path):
            return self._named(load_dir, step)
        return None

    def _newest_intact(self, skip: Collection[str] = ()) -> CheckpointInfo | None:
        """Auto-resume's pick: the newest checkpoint of the current line that passes ``verify_on_load``.

        A damaged newest checkpoint is skipped with a warning naming its problem and an older one is
        taken; if every one is damaged that is an error, never a silent fresh start. Explicit steps
        never fall back. Superseded checkpoints (a later run went back before them) are never picked,
        nor those in ``skip`` (a load found them unloadable).
        """
        damaged: list[CheckpointCorruptError] = []
        for _ in range(GONE_RETRIES + 1):
            gone = 0
            for info in reversed([i for i in self.list_checkpoints(load_dir=True) if not i.superseded]):
                if info.location in skip:
                    continue
                finite = info.meta.get("finite")
                if isinstance(finite, dict) and finite.get("ok") is False:
                    log.warning("skipping checkpoint %s (step %d): it records non-finite values", info.path, info.step)
                    continue
                try:
                    self.roots.load.check_info(info, self.config.verify_on_load)
                except CheckpointCorruptError as exc:
                    if self.roots.load.is_local and not info.path.exists():  # pruned by a live run
                        log.info("%s (step %d) was deleted while being checked; trying another", info.path, info.step)
                        gone += 1
                        continue
                    self.warn_once(
                        ("damaged", str(info.path), str(exc)),
                        "skipping damaged checkpoint %s (step %d), trying an older one: %s", info.path, info.step, exc,
                    )
                    damaged.append(exc)
                    continue
                return info
            if not gone or damaged:
                break  # the listing was current: nothing newer appeared while its checkpoints went
        if damaged:
            raise CheckpointCorruptError(
                f"every committed checkpoint in {self.config.resolved_load_dir} is damaged; the newest: {damaged[0]}"
            ) from damaged[0]
        return None
