"""Each new conformance check bites: a manager that breaks exactly one promise fails that check, by name.

Every broken manager here is the default manager with one thing taken away (a subclass that edits
the context it is handed), so a check that could never fail shows up as a passing broken manager.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointManager,
    DefaultCheckpointManager,
    LoadContext,
    LoadResult,
    SaveContext,
    SaveResult,
)
from checkpoint_manager.testing import (
    CONFORMANCE_CHECKS,
    ConformanceError,
    MakeManager,
    run_conformance_check,
    run_conformance_suite,
)

OLD_CHECKS = [
    "round_trip",
    "auto_without_checkpoint",
    "auto_loads_newest",
    "required",
    "never",
    "save_policy",
    "finalize_idempotent",
    "save_after_terminate",
    "context_manager",
    "load_step",
    "load_context_step",
]


def maker(kind: type[DefaultCheckpointManager], **fields: Any) -> MakeManager:
    def make(save_dir: Path, overrides: dict[str, Any]) -> CheckpointManager:
        return kind(CheckpointConfig(save_dir=str(save_dir), fsync=False, **fields, **overrides))

    return make


class EditsLoad(DefaultCheckpointManager):
    """Loads with ``changes`` applied to the LoadContext."""

    changes: dict[str, Any] = {}

    def should_load(self, ctx: LoadContext) -> bool:
        return super().should_load(dataclasses.replace(ctx, **self.changes))

    def load(self, ctx: LoadContext) -> LoadResult:
        return super().load(dataclasses.replace(ctx, **self.changes))


def edits_load(name: str, **changes: Any) -> type[EditsLoad]:
    return type(name, (EditsLoad,), {"changes": changes})


class LosesCounters(DefaultCheckpointManager):
    """Restores the train state but forgets its custom counters."""

    def load(self, ctx: LoadContext) -> LoadResult:
        result = super().load(ctx)
        if ctx.train_state is not None:
            ctx.train_state.counters = {}
        return result


class DropsDataloaderOnSave(DefaultCheckpointManager):
    def save(self, ctx: SaveContext) -> SaveResult | None:
        return super().save(dataclasses.replace(ctx, dataloader=None))


class SavesFinalTwice(DefaultCheckpointManager):
    """Treats every final save as forced: the end of training is written again."""

    def save(self, ctx: SaveContext) -> SaveResult | None:
        return super().save(dataclasses.replace(ctx, force=ctx.force or ctx.final))


class SloppyManager(DefaultCheckpointManager):
    """What a new user writes first: hands on the model, optimizer, scheduler, train state and step it
    was given, and nothing else (no data loader, no RNG, no extras, no strict, no path, no switches)."""

    def should_load(self, ctx: LoadContext) -> bool:
        return super().should_load(self._sloppy(ctx))

    def load(self, ctx: LoadContext) -> LoadResult:
        return super().load(self._sloppy(ctx))

    def save(self, ctx: SaveContext) -> SaveResult | None:
        return super().save(
            SaveContext(
                model=ctx.model,
                optimizer=ctx.optimizer,
                scheduler=ctx.scheduler,
                train_state=ctx.train_state,
                metrics=ctx.metrics,
                force=ctx.force,
                final=ctx.final,
            )
        )

    @staticmethod
    def _sloppy(ctx: LoadContext) -> LoadContext:
        return LoadContext(
            model=ctx.model,
            optimizer=ctx.optimizer,
            scheduler=ctx.scheduler,
            train_state=ctx.train_state,
            step=ctx.step,
            load_rng=False,
        )


BROKEN: list[tuple[str, MakeManager, str]] = [
    (
        "dataloader",
        maker(edits_load("DropsDataloader", dataloader=None)),
        "after save -> new manager -> load: dataloader['index'] is 1, expected 3 (the saved run)",
    ),
    (
        "dataloader",
        maker(DropsDataloaderOnSave),
        "after save -> new manager -> load: dataloader['index'] is 1, expected 3 (the saved run)",
    ),
    ("rng", maker(edits_load("DropsRng", load_rng=False)), "after save -> new manager -> load: the python RNG's next draws are ["),
    (
        "extras",
        maker(edits_load("DropsExtras", extra={})),
        "after save -> new manager -> load: extra['ema']['shadow'] differs from the saved run",
    ),
    (
        "scheduler",
        maker(edits_load("DropsScheduler", scheduler=None)),
        "after save -> new manager -> load: scheduler['last_epoch'] is 1, expected 3 (the saved run)",
    ),
    (
        "train_state",
        maker(edits_load("DropsTrainState", train_state=None)),
        "after save -> new manager -> load: train_state.step is 1, expected 3 (the saved run)",
    ),
    (
        "train_state",
        maker(LosesCounters),
        "after save -> new manager -> load: train_state.counters is {}, expected "
        "{'tokens': 192, 'skipped_batches': 2, 'loss_scale': 65536.0} (the saved run)",
    ),
    (
        "strict",
        maker(edits_load("NeverStrict", strict=False)),
        "load(LoadContext(strict=True)) into a model with a key the checkpoint lacks ('0.probe') returned "
        "LoadResult(",
    ),
    (
        "strict",
        maker(edits_load("AlwaysStrict", strict=True)),
        "load(LoadContext(strict=False)) into a model with a key the checkpoint lacks ('0.probe') raised "
        "CheckpointMismatchError: ",
    ),
    (
        "load_path",
        maker(edits_load("IgnoresPath", path=None)),
        "load(LoadContext(path='",
    ),
    (
        "load_context_step",
        maker(edits_load("IgnoresStep", step=None)),
        "load(LoadContext(step=1)) returned LoadResult(step=3); expected step=1",
    ),
    *[
        (
            switch,
            maker(edits_load(f"Ignores_{switch}", **{switch: True})),
            f"load(LoadContext({switch}=False)) changed the {part} it must leave alone: ",
        )
        for switch, part in (
            ("load_optimizer", "optimizer"),
            ("load_scheduler", "scheduler"),
            ("load_rng", "rng"),
            ("load_dataloader", "dataloader"),
            ("load_train_state", "train_state"),
            ("load_extra", "extra"),
        )
    ],
    (
        "final_save_once",
        maker(SavesFinalTwice),
        "save(SaveContext(final=True)) at step 3, right after save(SaveContext(final=True)) at step 3 returned "
        "SaveResult(",
    ),
]


@pytest.mark.parametrize(("check", "make", "message"), BROKEN, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(BROKEN)])
def test_a_manager_broken_in_one_way_fails_that_check(
    check: str, make: MakeManager, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConformanceError, match=re.escape(message)) as info:
        run_conformance_check(check, make, tmp_path)
    assert info.value.check == check
    assert str(info.value).startswith(f"{check}: ")


def test_every_new_check_has_a_broken_manager() -> None:
    assert set(CONFORMANCE_CHECKS) - set(OLD_CHECKS) <= {check for check, _, _ in BROKEN}


def test_the_sloppy_manager_passes_the_old_checks_and_fails_the_new_ones_by_name(tmp_path: Path) -> None:
    run_conformance_suite(maker(SloppyManager), tmp_path / "old", checks=OLD_CHECKS)
    with pytest.raises(ConformanceError) as info:
        run_conformance_suite(maker(SloppyManager), tmp_path / "new")
    assert sorted(info.value.failures) == sorted(
        [
            "dataloader",
            "rng",
            "extras",
            "strict",
            "load_path",
            "load_optimizer",
            "load_scheduler",
            "load_train_state",
        ]
    )
    text = str(info.value)
    assert text.startswith("8 conformance check(s) failed:\n")
    assert "\n  load_optimizer: load(LoadContext(load_optimizer=False)) changed the optimizer it must leave alone" in text
