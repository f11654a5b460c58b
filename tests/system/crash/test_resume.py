"""Resuming is bit-exact: a run SIGKILLed and resumed ends exactly where an uninterrupted run ends.

The runs are examples/train.py: an MLP with dropout (so the RNG matters), AdamW, a warmup+cosine
LambdaLR, and a shuffled StatefulDataLoader crossing epoch boundaries. "Exact" covers parameters,
optimizer state, LR, counters, the data order and losses of every resumed step, the next RNG draw
and the next batch.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.helpers.process import run_python
from tests.helpers.training import SMALL_RUN, ReferenceRun

STEPS, EVERY = SMALL_RUN["steps"], SMALL_RUN["save_every"]
STEPS_PER_EPOCH = SMALL_RUN["samples"] // 32


def assert_same_end_state(reference: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor]) -> None:
    for key in sorted(reference):
        if key.startswith(("model/", "optim/", "sched/", "state/counters", "next/")):
            assert torch.equal(reference[key], resumed[key]), f"{key} differs after resume"


def test_resume_from_every_checkpoint_is_bit_exact(
    trainer: ModuleType, reference_run: ReferenceRun, tmp_path: Path, deterministic_torch: None
) -> None:
    """Resuming from each checkpoint of the reference run, mid-epoch or on an epoch boundary."""
    steps = trainer.committed_steps(reference_run.save_dir)
    assert steps == list(range(EVERY, STEPS + 1, EVERY))
    assert any(s % STEPS_PER_EPOCH == 0 for s in steps[:-1]), "no resume from an epoch boundary"
    for step in steps[:-1]:
        cfg = trainer.RunConfig(save_dir=str(tmp_path / f"from_{step}"), load_dir=str(reference_run.save_dir),
                                load_step=step, verbose=False, **SMALL_RUN)
        resumed = trainer.train(cfg)
        assert int(resumed["state/resumed_from"][0]) == step
        assert trainer.compare(reference_run.result, resumed) == [], f"resume from step {step}"


@pytest.mark.parametrize(
    ("skipped", "differs"),
    [
        ("rng", "trace/loss"),  # other dropout masks
        ("dataloader", "trace/batches"),  # the epoch restarts from its first batch
        ("optimizer", "model/"),  # AdamW moments start from zero
    ],
)
def test_resume_without_a_piece_of_state_is_not_exact(
    skipped: str, differs: str, trainer: ModuleType, reference_run: ReferenceRun, tmp_path: Path,
    deterministic_torch: None,
) -> None:
    """The comparison above can fail: leave one piece of state out and the runs diverge."""
    cfg = trainer.RunConfig(save_dir=str(tmp_path / "run"), load_dir=str(reference_run.save_dir),
                            load_step=50, verbose=False, skip_on_load=(skipped,), **SMALL_RUN)
    resumed = trainer.train(cfg)
    assert int(resumed["state/resumed_from"][0]) == 50
    problems = trainer.compare(reference_run.result, resumed)
    assert any(line.startswith(differs) for line in problems), problems



def test_sigkill_mid_training_then_resume_is_bit_exact_demo(trainer: ModuleType, tmp_path: Path) -> None:
    """The README's first command: an uninterrupted run, a run SIGKILLed mid-training, its resume.

    Runs what scripts/demo.sh runs (smaller), then checks the files it leaves, not only its verdict.
    """
    steps, every = 90, 15
    proc = run_python(["examples/train.py", "demo", "--steps", str(steps), "--save-every", str(every),
                       "--hidden", "64", "--workdir", str(tmp_path)])
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("PASS: the killed-and-resumed run is bit-identical"), proc.stdout
    assert not any("DIFFER" in line for line in lines), proc.stdout
    match = re.search(r"SIGKILL\) while the child was at step (\d+); newest checkpoint: step (\d+)", proc.stdout)
    assert match, proc.stdout
    at_kill, newest_then = int(match[1]), int(match[2])
    assert at_kill >= newest_then + every // 3, "the kill should land mid-training, past the checkpoint"

    reference = trainer.load_result(tmp_path / "reference.safetensors")
    resumed = trainer.load_result(tmp_path / "resumed.safetensors")
    crashed_dir = tmp_path / "crashed"
    resumed_from = int(resumed["state/resumed_from"][0])
    # (one more save may have committed between the parent's last look and the signal)
    assert resumed_from in (newest_then, newest_then + every)
    assert 0 < resumed_from < steps
    assert resumed["trace/steps"].tolist() == list(range(resumed_from + 1, steps + 1))
    assert resumed["state/counters"].tolist() == reference["state/counters"].tolist()
    assert_same_end_state(reference, resumed)
    assert trainer.compare(reference, resumed) == []
    assert trainer.params_sha256(resumed) == trainer.params_sha256(reference)
    assert trainer.committed_steps(crashed_dir)[-1] == steps
    assert trainer.pending_entries(crashed_dir) == [], "the resumed run's manager sweeps .pending"


def test_async_saved_checkpoints_resume_bit_exact(
    trainer: ModuleType, reference_run: ReferenceRun, tmp_path: Path, deterministic_torch: None
) -> None:
    """Async saving changes nothing in training, and its checkpoints resume exactly like sync ones."""
    async_dir = tmp_path / "async"
    straight = trainer.train(trainer.RunConfig(save_dir=str(async_dir), async_save=True, verbose=False,
                                               **SMALL_RUN))
    assert trainer.compare(reference_run.result, straight) == []
    assert trainer.committed_steps(async_dir) == list(range(EVERY, STEPS + 1, EVERY))
    for step in (30, 80):
        resumed = trainer.train(trainer.RunConfig(
            save_dir=str(tmp_path / f"from_{step}"), load_dir=str(async_dir), load_step=step,
            async_save=True, verbose=False, **SMALL_RUN))
        assert int(resumed["state/resumed_from"][0]) == step
        assert trainer.compare(reference_run.result, resumed) == [], f"resume from async step {step}"
