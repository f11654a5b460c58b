"""The Lightning callback: real fits on CPU, stopped and resumed in a new Trainer, end bit-exact.

The uninterrupted reference run has no callback at all, so the comparison also proves that saving
does not disturb training (no RNG drawn, no state touched).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    DefaultCheckpointManager,
    ManagerClosedError,
    SaveContext,
    TrainState,
)
from checkpoint_manager.integrations import LightningCheckpointCallback
from checkpoint_manager.integrations.lightning import LOOPS_KEY

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

TOTAL_STEPS = 10  # 6 batches per epoch: the resumed runs cross an epoch boundary
MANAGERS = [None, "safetensors"]  # the default manager and the example plugin, by entry point


class TinyModule(pl.LightningModule):
    """Dropout (global RNG), AdamW and a per-step scheduler: every piece of state matters."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.fail_at:
            raise RuntimeError(f"injected failure at step {self.fail_at}")
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BatchCounter(pl.Callback):
    """A stateful callback: its count must survive the resume through the manager."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


def loader() -> StatefulDataLoader:
    """Resumable mid-epoch; the order depends only on (seed, epoch), and no global RNG is drawn.

    A plain shuffled StatefulDataLoader would resume the stopped epoch exactly but shuffle the next one
    differently (its generator is not part of its state), so the sampler is seeded per epoch.
    """
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1)
    return StatefulDataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(1))


def fit(max_steps: int, callback: pl.Callback | None = None, *, fail_at: int | None = None,
        seed: int = 123, accumulate: int = 1, more: tuple[pl.Callback, ...] = ()) -> tuple[TinyModule, pl.Trainer]:
    torch.manual_seed(seed)
    module = TinyModule(fail_at)
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=callback is not None,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate, callbacks=([callback] if callback is not None else []) + list(more),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "num_workers", "no val loop" and similar advice
        trainer.fit(module, loader())
    return module, trainer


@pytest.fixture(scope="module")
def reference() -> tuple[TinyModule, pl.Trainer]:
    return fit(TOTAL_STEPS)


def config(tmp_path: Path, manager: str | None, every: int, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(save_dir=str(tmp_path / "ckpt"), manager=manager, save_every_n_steps=every,
                            fsync=False, **kw)


def assert_same_run(ref: tuple[TinyModule, pl.Trainer], got: tuple[TinyModule, pl.Trainer]) -> None:
    """Same weights, optimizer moments, scheduler and counters as the run that never stopped."""
    (ref_module, ref_trainer), (module, trainer) = ref, got
    assert trainer.global_step == ref_trainer.global_step == TOTAL_STEPS
    for (name, a), b in zip(ref_module.state_dict().items(), module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ref_opt, opt = ref_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict()
    for key, slots in ref_opt["state"].items():
        for slot, value in slots.items():
            assert torch.equal(value, opt["state"][key][slot]), (key, slot)
    ref_sched, sched = ref_trainer.lr_scheduler_configs[0].scheduler, trainer.lr_scheduler_configs[0].scheduler
    assert sched.state_dict() == ref_sched.state_dict()
    assert trainer.current_epoch == ref_trainer.current_epoch


@pytest.mark.parametrize("manager", MANAGERS, ids=["default", "safetensors"])
def test_stop_at_max_steps_then_resume_is_bit_exact(
    manager: str | None, reference: tuple[TinyModule, pl.Trainer], tmp_path: Path
) -> None:
    cfg = config(tmp_path, manager, every=3)
    first = LightningCheckpointCallback(cfg)
    fit(4, first)  # saved by the policy at 3, by the final save at 4 (mid-epoch)
    assert first.load_result is None
    assert first.last_save is not None and first.last_save.step == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000003", "step_00000004"]

    second = LightningCheckpointCallback(cfg)
    got = fit(TOTAL_STEPS, second, seed=999)  # another seed: the RNG must come from the checkpoint
    assert second.load_result is not None and second.load_result.step == 4
    assert LOOPS_KEY in second.load_result.restored or f"extra.{LOOPS_KEY}" in second.load_result.restored
    assert_same_run(reference, got)
    ts = second.train_state
    assert (ts.step, ts.epoch, ts.consumed_samples) == (TOTAL_STEPS, reference[1].current_epoch, TOTAL_STEPS * 4)


@pytest.mark.parametrize("manager", MANAGERS, ids=["default", "safetensors"])
def test_crash_mid_run_then_resume_is_bit_exact(
    manager: str | None, reference: tuple[TinyModule, pl.Trainer], tmp_path: Path
) -> None:
    cfg = config(tmp_path, manager, every=2)
    with pytest.raises(RuntimeError, match="injected failure at step 9"):
        fit(TOTAL_STEPS, LightningCheckpointCallback(cfg), fail_at=9, more=(BatchCounter(),))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))[-1] == "step_00000008"

    second, counter = LightningCheckpointCallback(cfg), BatchCounter()
    got = fit(TOTAL_STEPS, second, seed=999, more=(counter,))  # resumes inside epoch 1 (sampler epoch 1)
    assert counter.batches == TOTAL_STEPS  # 8 restored + 2 run
    assert second.load_result is not None and second.load_result.step == 8
    assert_same_run(reference, got)
    assert second.train_state.consumed_samples == TOTAL_STEPS * 4


@pytest.mark.parametrize("stop", [3, 4], ids=["at-epoch-end", "mid-epoch-1"])
def test_gradient_accumulation_resume_is_bit_exact(stop: int, tmp_path: Path) -> None:
    """Two batches per optimizer step (3 steps per epoch): resumes at an epoch's last batch (where
    Lightning alone would count the epoch twice) and inside the next epoch."""
    reference = fit(TOTAL_STEPS, accumulate=2)
    cfg = config(tmp_path, None, every=TOTAL_STEPS)  # only the final save
    fit(stop, LightningCheckpointCallback(cfg), accumulate=2)
    second = LightningCheckpointCallback(cfg)
    got = fit(TOTAL_STEPS, second, seed=999, accumulate=2)
    assert second.load_result is not None and second.load_result.step == stop
    assert_same_run(reference, got)
    assert second.train_state.consumed_samples == TOTAL_STEPS * 2 * 4


def test_async_saves_are_committed_at_teardown_and_an_owned_manager_is_closed(tmp_path: Path) -> None:
    cfg = config(tmp_path, None, every=2, async_save=True)
    callback = LightningCheckpointCallback(cfg)
    fit(5, callback)
    steps = [c.step for c in DefaultCheckpointManager(config(tmp_path, None, every=2)).list_checkpoints()]
    assert steps == [2, 4, 5]
    with pytest.raises(ManagerClosedError):
        callback.manager.save(SaveContext(model=nn.Linear(1, 1), train_state=TrainState(step=99), force=True))


def test_a_manager_passed_in_stays_open(tmp_path: Path) -> None:
    manager = DefaultCheckpointManager(config(tmp_path, None, every=2))
    fit(3, LightningCheckpointCallback(manager))
    assert [c.step for c in manager.list_checkpoints()] == [2, 3]
    result = manager.save(SaveContext(model=nn.Linear(1, 1), train_state=TrainState(step=9), force=True))
    assert result is not None and result.step == 9


def test_resume_false_and_ckpt_path_conflict(tmp_path: Path) -> None:
    cfg = config(tmp_path, None, every=2)
    _, done = fit(2, LightningCheckpointCallback(cfg))
    done.save_checkpoint(tmp_path / "x.ckpt")
    fresh = LightningCheckpointCallback(cfg, resume=False)
    _, trainer = fit(1, fresh)  # would be "already done" at step 2 if it had resumed
    assert fresh.load_result is None and trainer.global_step == 1
    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[LightningCheckpointCallback(cfg)])
    with pytest.raises(ValueError, match=r"trainer.fit\(ckpt_path='.*x.ckpt'\) and a checkpoint manager"):
        trainer.fit(TinyModule(), loader(), ckpt_path=str(tmp_path / "x.ckpt"))


def test_initial_weights_start_a_fresh_fit(tmp_path: Path) -> None:
    """``initial_load_path`` (fine-tuning from a checkpoint): weights loaded, progress starts at 0."""
    source, _ = fit(3, LightningCheckpointCallback(config(tmp_path, None, every=3)))
    weights = {k: v.clone() for k, v in source.state_dict().items()}
    seen: dict[str, torch.Tensor] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen.update({k: v.clone() for k, v in module.state_dict().items()})

    cfg = CheckpointConfig(save_dir=str(tmp_path / "finetune"), fsync=False,
                           initial_load_path=str(tmp_path / "ckpt" / "step_00000003"))
    callback = LightningCheckpointCallback(cfg)
    _, trainer = fit(2, callback, more=(Capture(),))
    assert callback.load_result is not None and callback.load_result.restored == ("model",)
    assert seen.keys() == weights.keys() and all(torch.equal(seen[k], weights[k]) for k in weights)
    assert trainer.global_step == 2 and callback.last_save is not None and callback.last_save.step == 2


def test_importing_the_package_imports_no_framework() -> None:
    code = (
        "import sys, checkpoint_manager, checkpoint_manager.integrations as i\n"
        "assert sorted(i.__all__) == sorted(dir(i))\n"
        "heavy = [m for m in ('pytorch_lightning', 'lightning', 'transformers', 'accelerate') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class FailingFinalize(DefaultCheckpointManager):
    """A manager whose background save failed: the error must reach the caller of training."""

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        super().finalize_async_saves(blocking=blocking, terminate=terminate)
        raise AsyncSaveError("background write of step_00000002 failed: disk full")


def test_an_async_save_error_is_raised_from_training(tmp_path: Path) -> None:
    with pytest.raises(AsyncSaveError, match="step_00000002 failed: disk full"):
        fit(3, LightningCheckpointCallback(FailingFinalize(config(tmp_path, None, every=2))))
