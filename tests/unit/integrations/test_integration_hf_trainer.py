"""The Hugging Face Trainer callback: real training on CPU, stopped and resumed, ends bit-exact.

The uninterrupted reference is a plain ``Trainer`` without the callback, so the comparison also proves
that saving disturbs nothing. The resumed Trainer gets another ``seed``: its RNG must come from the
checkpoint (``data_seed`` keeps the data order the same in all runs).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    DefaultCheckpointManager,
    ManagerClosedError,
    SaveContext,
    TrainState,
)
from checkpoint_manager.integrations import CheckpointManagerTrainer, HFCheckpointCallback

transformers.logging.set_verbosity_error()

TOTAL_STEPS = 10  # 24 samples, batches of 4: 6 steps per epoch, so resumed runs cross an epoch end
MANAGERS = [None, "safetensors"]  # the default manager and the example plugin, by entry point


class Tiny(nn.Module):
    """Dropout draws from the global RNG: a resume that restores it wrongly changes the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x) - labels).pow(2).mean()}


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(24)]


class StopAt(TrainerCallback):
    """A graceful stop (as a time limit would do) without changing max_steps and so the LR schedule."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


class CrashAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")


def train(tmp_path: Path, callbacks: list[TrainerCallback], *, cls: type[Trainer] = CheckpointManagerTrainer,
          seed: int = 123, name: str = "run") -> Trainer:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=TOTAL_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-2, lr_scheduler_type="linear", save_strategy="no", report_to="none",
        disable_tqdm=True, use_cpu=True, seed=seed, data_seed=1, logging_steps=1, dataloader_num_workers=0,
    )
    trainer = cls(model=Tiny(), args=args, train_dataset=dataset(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    return train(tmp_path_factory.mktemp("ref"), [], cls=Trainer)


def config(tmp_path: Path, manager: str | None, every: int, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(save_dir=str(tmp_path / "ckpt"), manager=manager, save_every_n_steps=every,
                            fsync=False, **kw)


def saved_steps(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))


def assert_same_run(ref: Trainer, got: Trainer) -> None:
    assert got.state.global_step == ref.state.global_step == TOTAL_STEPS
    assert got.state.epoch == ref.state.epoch
    for (name, a), b in zip(ref.model.state_dict().items(), got.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ref_opt, opt = ref.optimizer.state_dict(), got.optimizer.state_dict()
    for key, slots in ref_opt["state"].items():
        for slot, value in slots.items():
            assert torch.equal(value, opt["state"][key][slot]), (key, slot)
    assert got.lr_scheduler.state_dict() == ref.lr_scheduler.state_dict()
    ref_losses = [e["loss"] for e in ref.state.log_history if "loss" in e]
    assert [e["loss"] for e in got.state.log_history if "loss" in e] == ref_losses  # history carried over


@pytest.mark.parametrize("manager", MANAGERS, ids=["default", "safetensors"])
def test_stop_then_resume_is_bit_exact(manager: str | None, reference: Trainer, tmp_path: Path) -> None:
    cfg = config(tmp_path, manager, every=3)
    first = HFCheckpointCallback(cfg)
    train(tmp_path, [first, StopAt(4)], name="a")  # saved at 3 by the policy, at 4 by the final save
    assert first.load_result is None and first.last_save is not None and first.last_save.step == 4
    assert saved_steps(tmp_path) == ["step_00000003", "step_00000004"]

    second = HFCheckpointCallback(cfg)
    got = train(tmp_path, [second], seed=999, name="b")
    assert second.load_result is not None and second.load_result.step == 4
    assert_same_run(reference, got)
    assert (second.train_state.step, second.train_state.epoch) == (TOTAL_STEPS, 1)


@pytest.mark.parametrize("manager", MANAGERS, ids=["default", "safetensors"])
def test_crash_then_resume_is_bit_exact(manager: str | None, reference: Trainer, tmp_path: Path) -> None:
    cfg = config(tmp_path, manager, every=2)
    with pytest.raises(RuntimeError, match="injected failure at step 7"):
        train(tmp_path, [HFCheckpointCallback(cfg), CrashAt(7)], name="a")
    assert saved_steps(tmp_path)[-1] == "step_00000006"  # the last step of epoch 0

    second = HFCheckpointCallback(cfg)
    got = train(tmp_path, [second], seed=999, name="b")
    assert second.load_result is not None and second.load_result.step == 6
    assert_same_run(reference, got)


def test_plain_trainer_saves_but_refuses_to_restart_over_a_checkpoint(tmp_path: Path) -> None:
    cfg = config(tmp_path, None, every=5)
    train(tmp_path, [HFCheckpointCallback(cfg)], cls=Trainer, name="a")
    assert saved_steps(tmp_path) == ["step_00000005", "step_00000010"]
    with pytest.raises(RuntimeError, match="use CheckpointManagerTrainer"):
        train(tmp_path, [HFCheckpointCallback(cfg)], cls=Trainer, name="b")
    fresh = HFCheckpointCallback(config(tmp_path, None, every=None), resume=False)
    got = train(tmp_path, [fresh], cls=Trainer, name="c")
    assert fresh.load_result is None and got.state.global_step == TOTAL_STEPS


def test_async_saves_are_committed_and_an_owned_manager_is_closed(tmp_path: Path) -> None:
    callback = HFCheckpointCallback(config(tmp_path, None, every=4, async_save=True))
    train(tmp_path, [callback])
    listed = DefaultCheckpointManager(config(tmp_path, None, every=4)).list_checkpoints()
    assert [c.step for c in listed] == [4, 8, 10]
    with pytest.raises(ManagerClosedError):
        callback.manager.save(SaveContext(model=nn.Linear(1, 1), train_state=TrainState(step=99), force=True))


def test_a_manager_passed_in_stays_open(tmp_path: Path) -> None:
    manager = DefaultCheckpointManager(config(tmp_path, None, every=5))
    train(tmp_path, [HFCheckpointCallback(manager)])
    assert [c.step for c in manager.list_checkpoints()] == [5, 10]
    assert manager.save(SaveContext(model=nn.Linear(1, 1), train_state=TrainState(step=11), force=True))


@pytest.mark.parametrize("cls", [CheckpointManagerTrainer, Trainer], ids=["mixin", "plain"])
def test_initial_weights_start_a_fresh_run(cls: type[Trainer], tmp_path: Path) -> None:
    """``initial_load_path`` (fine-tuning from a checkpoint): weights loaded, counters start at 0."""
    source = train(tmp_path, [HFCheckpointCallback(config(tmp_path, None, every=TOTAL_STEPS))], name="a")
    weights = {k: v.clone() for k, v in source.model.state_dict().items()}
    seen: dict[str, torch.Tensor] = {}

    class Capture(TrainerCallback):  # runs after the checkpoint callback, at train begin
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            seen.update({k: v.clone() for k, v in model.state_dict().items()})

    cfg = CheckpointConfig(save_dir=str(tmp_path / "finetune"), fsync=False,
                           initial_load_path=str(tmp_path / "ckpt" / "step_00000010"))
    callback = HFCheckpointCallback(cfg)
    got = train(tmp_path, [callback, Capture()], cls=cls, name="b")
    assert callback.load_result is not None and callback.load_result.restored == ("model",)
    assert seen.keys() == weights.keys() and all(torch.equal(seen[k], weights[k]) for k in weights)
    assert got.state.global_step == TOTAL_STEPS and callback.last_save is not None
    assert callback.last_save.step == TOTAL_STEPS  # the final save of the new run


class FailingFinalize(DefaultCheckpointManager):
    """A manager whose background save failed: the error must reach the caller of training."""

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        super().finalize_async_saves(blocking=blocking, terminate=terminate)
        raise AsyncSaveError("background write of step_00000002 failed: disk full")


def test_an_async_save_error_is_raised_from_training(tmp_path: Path) -> None:
    with pytest.raises(AsyncSaveError, match="step_00000002 failed: disk full"):
        train(tmp_path, [HFCheckpointCallback(FailingFinalize(config(tmp_path, None, every=2)))])
