"""cm_torchtitan and torchtitan's own DCP backend, both ways; and how the backend is selected.

torchtitan's backend runs as torchtitan ships it (``torchtitan.components.checkpointer``), on the
same containers: its ``step-N`` checkpoints resume under ours bit-exactly, and ours reach it through
the Hugging Face export its ``initial_load_in_hf`` reads (it cannot read ours directly: see
docs/integrations.md).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info < (3, 11):  # scripts/venv.sh leaves this plugin out on older Pythons
    pytest.skip("torchtitan needs Python 3.11", allow_module_level=True)
import torch
from cm_torchtitan import TorchTitanCheckpointManager, find_titan_steps
from titan_fixtures import STEPS, deterministic, reference
from titan_rig import TokenStream, assert_same, build_rig, checkpointer, snapshot, train
from torchtitan.config import ConfigManager

__all__ = ["deterministic", "reference"]  # fixtures, used by name

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),  # torchdata's, on every loader
    pytest.mark.filterwarnings("ignore:To get the last learning rate"),  # torchtitan's scheduler load
    pytest.mark.filterwarnings("ignore::checkpoint_manager.MissingConfigWarning"),  # no HF config.json here
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # torchtitan's backend, one process
]

Ref = dict[int, dict[str, torch.Tensor]]


def torchtitan_run(folder: Path, stop_at: int, *, total: int = STEPS, **fields: Any) -> Any:
    """torchtitan's DCP backend (no process group here: it purges through one, so keep_latest_k=0)."""
    rig = build_rig(steps=total)
    ckpt = checkpointer(rig, folder, dcp=True, keep_latest_k=0, **fields)
    train(rig, ckpt, total, stop_at=stop_at)
    ckpt.close()
    return rig


def model_equal(a: Any, b: Any) -> None:
    for (name, x), (_, y) in zip(a.model_parts[0].named_parameters(), b.model_parts[0].named_parameters(), strict=True):
        assert torch.equal(x, y), name


def test_resume_from_torchtitans_dcp_checkpoint_is_bit_exact(tmp_path: Path, reference: Ref) -> None:
    torchtitan_run(tmp_path, 4, interval=2, last_save_model_only=False)
    assert sorted(find_titan_steps(str(tmp_path))) == [2, 4]
    rig = build_rig(steps=STEPS)
    ckpt = checkpointer(rig, tmp_path, interval=2)
    ckpt.load()
    assert_same(snapshot(rig), reference[4])
    report = ckpt.last_load
    assert (report.step, report.restored) == (4, ["model", "optimizer", "lr_scheduler", "train_state", "dataloader"])
    assert report.not_restored == {"rng": "torchtitan's checkpoints hold no RNG state"}
    train(rig, ckpt, STEPS)  # and on from there, saving our own checkpoints beside torchtitan's
    ckpt.close()
    assert_same(snapshot(rig), reference[STEPS])
    assert (tmp_path / "step-4").is_dir() and (tmp_path / f"step_{STEPS:08d}" / "checkpoint.json").is_file()


def test_load_step_names_a_torchtitan_step(tmp_path: Path, reference: Ref) -> None:
    torchtitan_run(tmp_path, 4, interval=2, last_save_model_only=False)
    rig = build_rig(steps=STEPS)
    checkpointer(rig, tmp_path, load_step=2).load(step=2)
    assert_same(snapshot(rig), reference[2])


def test_a_torchtitan_checkpoint_as_initial_weights(tmp_path: Path, reference: Ref) -> None:
    torchtitan_run(tmp_path / "pretrain", 4, interval=2, last_save_model_only=False)
    rig = build_rig(steps=STEPS)
    ckpt = checkpointer(rig, tmp_path / "run", initial_load_path=str(tmp_path / "pretrain" / "step-4"))
    ckpt.load()
    got = snapshot(rig)
    for key in (k for k in reference[4] if k.startswith("model.")):
        assert torch.equal(got[key], reference[4][key]), key
    assert got["trainer.step"].item() == 0 and got["sched.last_epoch"].item() == 0
    assert ckpt.last_load.restored == ["model"]
    assert set(ckpt.last_load.skipped) == {"optimizer", "lr_scheduler", "train_state", "dataloader"}


class TensorStream(TokenStream):
    """A dataset whose position holds a tensor: torchtitan pickles it with torch's classes."""

    def state_dict(self) -> dict[str, Any]:
        return {"index": torch.tensor(self.index)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def test_a_loader_pickle_that_needs_code_is_reported_never_run(
    tmp_path: Path, reference: Ref, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = build_rig(steps=STEPS)
    rig.dataloader.dataset.__class__ = TensorStream
    ckpt = checkpointer(rig, tmp_path, dcp=True, keep_latest_k=0, interval=2, last_save_model_only=False)
    train(rig, ckpt, STEPS, stop_at=2)
    ckpt.close()
    calls: list[bytes] = []
    monkeypatch.setattr(pickle, "loads", lambda data, *a, **k: calls.append(data))
    fresh = build_rig(steps=STEPS)
    ours = checkpointer(fresh, tmp_path)
    ours.load()
    assert calls == []  # torchtitan's own loader would have unpickled it
    assert "torch._utils._rebuild_tensor_v2" in ours.last_load.not_restored["dataloader"]
    assert ours.last_load.restored == ["model", "optimizer", "lr_scheduler", "train_state"]
    got = snapshot(fresh)
    assert got["data.index"].item() == 0 and got["trainer.step"].item() == 2
    for key in (k for k in reference[2] if k.startswith(("model.", "optim0."))):
        assert torch.equal(got[key], reference[2][key]), key


def test_torchtitans_hf_export_as_our_initial_weights(tmp_path: Path) -> None:
    source = torchtitan_run(tmp_path / "tt", 3, total=3, interval=100, last_save_in_hf=True)
    hf_dir = tmp_path / "tt" / "step-3"
    rig = build_rig(steps=STEPS, seed=1)
    ckpt = checkpointer(rig, tmp_path / "ours", initial_load_path=str(hf_dir), initial_load_in_hf=True)
    ckpt.load()
    model_equal(rig, source)
    assert ckpt.last_load.restored == ["model"]


def test_our_hf_export_into_torchtitans_dcp_backend(tmp_path: Path) -> None:
    rig = build_rig(steps=3, seed=2)
    ours = checkpointer(rig, tmp_path / "ours", interval=100, last_save_in_hf=True)
    train(rig, ours, 3)
    ours.close()
    other = build_rig(steps=3, seed=3)
    theirs = checkpointer(
        other,
        tmp_path / "tt",
        dcp=True,
        keep_latest_k=0,
        initial_load_path=str(tmp_path / "ours" / "step_00000003" / "hf"),
        initial_load_in_hf=True,
    )
    assert theirs.load() is True
    model_equal(other, rig)


@pytest.mark.parametrize(
    "argv",
    [
        # our fields are --checkpoint.* flags: the config function already holds our Config; the
        # dict fields (tyro parses no dict[str, Any]) come through the override's JSON
        [
            "--module", "cm_torchtitan", "--config", "llama3_debugmodel",
            "--checkpoint.keep_best", "3", "--checkpoint.monitor", "loss_metrics/global_avg_loss",
            "--override.imports", 'cm_torchtitan.override.use_checkpoint_manager={"options": {"save_at_steps": [7]}}',
        ],
        # torchtitan parses its own Config, so ours come as the override's JSON
        [
            "--module", "llama3", "--config", "llama3_debugmodel", "--override.imports",
            'cm_torchtitan.override.use_checkpoint_manager={"keep_best": 3, "monitor": "loss_metrics/global_avg_loss",'
            ' "options": {"save_at_steps": [7]}}',
        ],
    ],
    ids=["module", "override"],
)
def test_selected_by_torchtitans_command_line(argv: list[str]) -> None:
    config = ConfigManager().parse_args(
        [*argv, "--checkpoint.enable", "--checkpoint.interval", "5"]
    )
    if config.override.imports:  # applied by the trainer before it builds anything
        from torchtitan.config.override import apply_overrides

        apply_overrides(config.override, config)
    checkpoint = config.checkpoint
    assert type(checkpoint) is TorchTitanCheckpointManager.Config
    assert (checkpoint.enable, checkpoint.interval, checkpoint.keep_best) == (True, 5, 3)
    assert checkpoint.monitor == "loss_metrics/global_avg_loss" and checkpoint.options == {"save_at_steps": [7]}
    assert checkpoint.last_save_model_only is False  # llama3_debugmodel's own value, kept
