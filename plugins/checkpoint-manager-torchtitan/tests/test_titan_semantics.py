"""Each torchtitan checkpoint field, honoured by cm_torchtitan; and what the backend adds.

The loop is torchtitan's (titan_rig.train); the containers are torchtitan's, around its Llama 3
debug model on CPU. A resumed state is compared, tensor by tensor, with the snapshot of a run that
never saved (``reference``).
"""

from __future__ import annotations

import json
import pickle
import sys
import types
from pathlib import Path

import pytest

if sys.version_info < (3, 11):  # scripts/venv.sh leaves this plugin out on older Pythons
    pytest.skip("torchtitan needs Python 3.11", allow_module_level=True)
import torch
from cm_torchtitan import TorchTitanCheckpointManager, loads_plain_data
from cm_torchtitan.manager import MARK_DTYPE, MARK_MODEL_ONLY
from safetensors.torch import load_file
from titan_fixtures import STEPS, committed_steps, deterministic, reference
from titan_rig import assert_same, build_rig, checkpointer, snapshot, train
from torchtitan.components.metrics import BaseLogger

from checkpoint_manager import CheckpointNotFoundError, NonFiniteStateError, UnsafeCheckpointError
from checkpoint_manager.engine.dcp.io import read_dcp_metadata

__all__ = ["deterministic", "reference"]  # fixtures, used by name

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),  # torchdata's, on every loader
    pytest.mark.filterwarnings("ignore:To get the last learning rate"),  # torchtitan's scheduler load
    pytest.mark.filterwarnings("ignore::checkpoint_manager.MissingConfigWarning"),  # no HF config.json here
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # torchtitan's backend, one process
]

Ref = dict[int, dict[str, torch.Tensor]]


def run(folder: Path, stop_at: int, *, total: int = STEPS, **fields: object) -> tuple[object, TorchTitanCheckpointManager]:
    """A run of ``total`` steps (``training.steps``) that stops after ``stop_at``."""
    rig = build_rig(steps=total)
    ckpt = checkpointer(rig, folder, **fields)
    train(rig, ckpt, total, stop_at=stop_at)
    ckpt.close()
    return rig, ckpt


def resumed(folder: Path, **fields: object) -> tuple[object, TorchTitanCheckpointManager]:
    """A fresh process's state after ``load``, as torchtitan's trainer starts (nothing trained yet)."""
    rig = build_rig(steps=STEPS)
    ckpt = checkpointer(rig, folder, **fields)
    ckpt.load(step=fields.get("load_step", -1))  # type: ignore[arg-type]
    return rig, ckpt


# -- when to save -----------------------------------------------------------------------------------
def test_interval_saves_its_multiples_and_the_last_step(tmp_path: Path) -> None:
    run(tmp_path, 5, total=5, interval=2, keep_latest_k=0)
    assert committed_steps(tmp_path) == [2, 4, 5]


def test_enable_first_step_checkpoint_saves_step_one(tmp_path: Path) -> None:
    run(tmp_path, 3, interval=4, enable_first_step_checkpoint=True, keep_latest_k=0)
    assert committed_steps(tmp_path) == [1]


def test_a_save_policy_of_ours_decides_beside_interval(tmp_path: Path) -> None:
    run(tmp_path, 5, interval=4, keep_latest_k=0, options={"save_at_steps": [3]})
    assert committed_steps(tmp_path) == [3, 4]


def test_keep_latest_k_keeps_only_the_newest(tmp_path: Path) -> None:
    run(tmp_path, 6, interval=1, keep_latest_k=2, last_save_model_only=False)
    assert committed_steps(tmp_path) == [5, 6]


def test_load_only_never_saves_and_leaves_the_directory_unlocked(tmp_path: Path, reference: Ref) -> None:
    run(tmp_path, 2, interval=2)
    rig = build_rig(steps=STEPS)
    reader = checkpointer(rig, tmp_path, interval=1, load_only=True)
    writer = checkpointer(build_rig(steps=STEPS), tmp_path, interval=1)  # would fail on a held lock
    writer.close()
    train(rig, reader, STEPS, stop_at=4)
    reader.close()
    assert committed_steps(tmp_path) == [2]
    assert_same(snapshot(rig), reference[4])


# -- what to load -----------------------------------------------------------------------------------
@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_is_bit_exact_in_every_async_mode(tmp_path: Path, reference: Ref, async_mode: str) -> None:
    rig = build_rig(steps=STEPS)
    ckpt = checkpointer(rig, tmp_path, interval=2, async_mode=async_mode)
    seen: list[bool] = []
    train(rig, ckpt, STEPS, stop_at=4, after_step=lambda step: seen.append(ckpt.save_future is not None))
    pending = async_mode != "disabled"
    assert seen == [False, pending, pending, pending]  # until torchtitan waits for it (or the next save)
    ckpt.maybe_wait_for_saving()
    assert ckpt.save_future is None and committed_steps(tmp_path) == [2, 4]
    ckpt.close()
    rig, ckpt = resumed(tmp_path, interval=2, async_mode=async_mode)
    assert_same(snapshot(rig), reference[4])
    train(rig, ckpt, STEPS)
    ckpt.close()
    assert_same(snapshot(rig), reference[STEPS])


def test_load_step_resumes_that_step(tmp_path: Path, reference: Ref) -> None:
    run(tmp_path, 6, interval=2, last_save_model_only=False, keep_latest_k=0)
    rig, _ = resumed(tmp_path, load_step=4)
    assert_same(snapshot(rig), reference[4])
    with pytest.raises(CheckpointNotFoundError, match=r"load_step=3: no checkpoint of that step in"):
        resumed(tmp_path, load_step=3)


def test_exclude_from_loading_starts_those_fresh(tmp_path: Path, reference: Ref) -> None:
    run(tmp_path, 4, interval=2)
    rig, ckpt = resumed(tmp_path, exclude_from_loading=["optimizer", "lr_scheduler", "dataloader"])
    got, want = snapshot(rig), reference[4]
    assert {k: v for k, v in got.items() if k.startswith("model.")}.keys() == {
        k for k in want if k.startswith("model.")
    }
    for key in (k for k in want if k.startswith("model.")):
        assert torch.equal(got[key], want[key]), key
    assert not [k for k in got if k.startswith("optim0.") and not k.endswith(".lr")]  # no state
    assert got["sched.last_epoch"].item() == 0 and got["data.index"].item() == 0
    assert got["trainer.step"].item() == 4  # train_state was not excluded
    assert set(ckpt.last_load.skipped) >= {"optim", "dataloader"}


def test_exclude_from_loading_is_checked_as_torchtitan_checks_it(tmp_path: Path) -> None:
    rig = build_rig()
    with pytest.raises(ValueError, match=r"exclude_from_loading: 'ema' not found in the checkpointed states"):
        checkpointer(rig, tmp_path, exclude_from_loading=["ema"])
    with pytest.raises(ValueError, match="model key shouldn't be in exclude_from_loading"):
        checkpointer(rig, tmp_path, exclude_from_loading=["model"])


def test_initial_load_path_model_only_takes_the_weights_alone(tmp_path: Path, reference: Ref) -> None:
    run(tmp_path / "pretrain", 4, interval=2)
    rig, ckpt = resumed(tmp_path / "run", initial_load_path=str(tmp_path / "pretrain"))
    got = snapshot(rig)
    for key in (k for k in reference[4] if k.startswith("model.")):
        assert torch.equal(got[key], reference[4][key]), key
    assert got["trainer.step"].item() == 0 and got["sched.last_epoch"].item() == 0
    assert ckpt.last_load.restored == ("model",)


def test_initial_load_path_whole_state(tmp_path: Path, reference: Ref) -> None:
    run(tmp_path / "pretrain", 4, interval=2)
    rig, _ = resumed(tmp_path / "run", initial_load_path=str(tmp_path / "pretrain"), initial_load_model_only=False)
    assert_same(snapshot(rig), reference[4])


def test_a_checkpoint_in_folder_wins_over_initial_load_path(tmp_path: Path, reference: Ref) -> None:
    run(tmp_path / "pretrain", 2, interval=2)
    run(tmp_path / "run", 4, interval=4)
    rig, _ = resumed(tmp_path / "run", initial_load_path=str(tmp_path / "pretrain"))
    assert_same(snapshot(rig), reference[4])


# -- the last step and the seed ---------------------------------------------------------------------
def test_last_save_model_only_in_export_dtype(tmp_path: Path, reference: Ref) -> None:
    run(tmp_path, STEPS, interval=100, export_dtype="bfloat16")
    final = tmp_path / f"step_{STEPS:08d}"
    meta = json.loads((final / "checkpoint.json").read_text())
    assert meta["train_state"]["counters"] == {MARK_MODEL_ONLY: 1, MARK_DTYPE: 1}
    saved = read_dcp_metadata(final).state_dict_metadata
    weights = {k: v for k, v in saved.items() if k.startswith("model.")}
    assert weights and all(v.properties.dtype == torch.bfloat16 for v in weights.values())
    assert not [k for k in saved if k.startswith(("optim", "extra.lr_scheduler"))]
    # a restart after the end loads the weights (back in float32) and knows it is done
    rig, _ = resumed(tmp_path, export_dtype="bfloat16")
    got, want = snapshot(rig), reference[STEPS]
    for key in (k for k in want if k.startswith("model.")):
        assert torch.equal(got[key], want[key].to(torch.bfloat16).float()), key
    assert got["trainer.step"].item() == STEPS and got["sched.last_epoch"].item() == 0


def test_last_save_in_hf_writes_the_adapters_names(tmp_path: Path, reference: Ref) -> None:
    rig, _ = run(tmp_path, STEPS, interval=100, last_save_in_hf=True, export_dtype="bfloat16")
    hf = load_file(str(tmp_path / f"step_{STEPS:08d}" / "hf" / "model.safetensors"))
    canonical = {k: v for k, v in rig.model_parts[0].state_dict().items()}
    want = rig.adapter.to_hf({k: v.to(torch.bfloat16) for k, v in canonical.items()})
    assert hf.keys() == want.keys() and "model.layers.0.self_attn.q_proj.weight" in hf
    for key, tensor in want.items():
        assert hf[key].dtype == torch.bfloat16 and torch.equal(hf[key], tensor), key


def test_create_seed_checkpoint_then_train_from_it(tmp_path: Path) -> None:
    seed = build_rig(seed=7)
    maker = checkpointer(seed, tmp_path, create_seed_checkpoint=True)
    assert maker.save(curr_step=0, last_step=True)  # what torchtitan's train.py does
    maker.close()
    assert committed_steps(tmp_path) == [0]
    rig, _ = resumed(tmp_path)
    got, want = snapshot(rig), snapshot(seed)
    for key in (k for k in want if k.startswith("model.")):
        assert torch.equal(got[key], want[key]), key
    assert got["trainer.step"].item() == 0 and not [k for k in got if ".exp_avg" in k]


def test_disabled_checkpointer_does_nothing(tmp_path: Path) -> None:
    rig = build_rig()
    ckpt = checkpointer(rig, tmp_path, enable=False)
    assert ckpt.load() is False and ckpt.save(2, last_step=True) is False
    ckpt.close()
    assert not tmp_path.joinpath("step_00000002").exists()


# -- what the backend adds --------------------------------------------------------------------------
def test_keep_best_ranks_by_what_the_trainer_logs(tmp_path: Path) -> None:
    rig = build_rig()
    logged: list[tuple[dict[str, float], int]] = []

    class Recording(BaseLogger):
        def log(self, metrics: dict[str, float], step: int) -> None:
            logged.append((metrics, step))

    rig.trainer.metrics_processor = types.SimpleNamespace(logger=Recording())  # type: ignore[attr-defined]
    ckpt = checkpointer(rig, tmp_path, interval=1, keep_latest_k=2, keep_best=1, monitor="val", last_save_model_only=False)
    values = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0}
    train(rig, ckpt, STEPS, stop_at=5, log_metrics=lambda step, _loss: rig.trainer.metrics_processor.logger.log({"val": values[step]}, step))
    ckpt.close()
    assert [s for _, s in logged] == [1, 2, 3, 4, 5]  # torchtitan's own logger still gets every call
    assert committed_steps(tmp_path) == [2, 4, 5]  # the best (val 1.0) and the newest two
    best = json.loads((tmp_path / "step_00000002" / "checkpoint.json").read_text())
    assert best["metrics"] == {"val": 1.0}


def test_record_metrics_from_a_custom_loop(tmp_path: Path) -> None:
    rig = build_rig()
    ckpt = checkpointer(rig, tmp_path, interval=2, keep_latest_k=0, last_save_model_only=False)
    train(rig, ckpt, STEPS, stop_at=2, log_metrics=lambda step, _loss: ckpt.record_metrics({"loss": torch.tensor(0.5), "note": "x"}))
    ckpt.close()
    assert json.loads((tmp_path / "step_00000002" / "checkpoint.json").read_text())["metrics"] == {"loss": 0.5}


def test_check_finite_refuses_a_broken_model(tmp_path: Path) -> None:
    rig = build_rig()
    ckpt = checkpointer(rig, tmp_path, interval=1, check_finite=True)
    with torch.no_grad():
        rig.model_parts[0].norm.weight[0] = float("nan")
    with pytest.raises(NonFiniteStateError, match=r"norm\.weight"):
        ckpt.save(1)
    ckpt.close()
    assert committed_steps(tmp_path) == []
    ckpt = checkpointer(rig, tmp_path / "b", interval=1, check_finite=True, on_save_error="continue")
    assert ckpt.save(1) is False  # reported, training goes on
    ckpt.close()


def test_the_data_loader_position_is_saved_without_pickle(tmp_path: Path) -> None:
    run(tmp_path, 2, interval=1)
    rank_state = json.loads((tmp_path / "step_00000001" / "rank_00000.json").read_text())
    loader = rank_state["dataloader"]
    assert loader["dp_world_size"] == 1 and "__cm__" not in json.dumps(loader["loader"]).replace('"__cm__": "tuple"', "")
    assert loads_plain_data(pickle.dumps({"a": [1, 2.5, "b", b"c", None]}), "x") == {"a": [1, 2.5, "b", b"c", None]}

    with pytest.raises(UnsafeCheckpointError, match=r"refuses to load global torch\._utils\._rebuild_tensor_v2"):
        loads_plain_data(pickle.dumps({"t": torch.zeros(1)}), "dp_rank_0")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"keep_best": 2}, "keep_best needs monitor"),
        ({"options": {"save_dir": "/x"}}, "options\\['save_dir'\\]: set the torchtitan field 'folder' instead"),
        ({"options": {"keep_last": 2}}, "set the torchtitan field 'keep_latest_k' instead"),
        ({"local_dir": "/tmp/x"}, "local_dir is a field of the tiered manager"),
        ({"async_mode": "sometimes"}, "Invalid async_mode: sometimes"),
        ({"keep_latest_k": 1}, "at least 2 checkpoint replicas"),
    ],
)
def test_bad_config_is_refused_when_parsed(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TorchTitanCheckpointManager.Config(enable=True, **fields)  # type: ignore[arg-type]


def test_an_unknown_option_names_the_field_meant(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="verify_onload"):
        checkpointer(build_rig(), tmp_path, options={"verify_onload": "full"})


def test_save_frozen_once_shares_a_frozen_embedding(tmp_path: Path) -> None:
    ref = build_rig(steps=STEPS, frozen=("tok_embeddings",))
    train(ref, checkpointer(ref, tmp_path / "never", enable=False), STEPS)
    rig = build_rig(steps=STEPS, frozen=("tok_embeddings",))
    ckpt = checkpointer(rig, tmp_path / "run", interval=1, keep_latest_k=2, save_frozen="once")
    train(rig, ckpt, STEPS, stop_at=3)
    ckpt.close()
    assert committed_steps(tmp_path / "run") == [2, 3]
    for step in (2, 3):
        record = json.loads((tmp_path / "run" / f"step_{step:08d}" / "checkpoint.json").read_text())["frozen"]
        assert [v["how"] for v in record["files"].values()] == ["link"] and record["written_bytes"] == 0
    rig = build_rig(steps=STEPS, frozen=("tok_embeddings",), seed=1)
    ckpt = checkpointer(rig, tmp_path / "run", interval=1, keep_latest_k=2, save_frozen="once")
    train(rig, ckpt, STEPS)
    ckpt.close()
    assert_same(snapshot(rig), snapshot(ref))


def test_a_folder_in_object_storage(reference: Ref) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository's S3 server
    from tests.helpers.s3_server import MotoS3, storage_options

    with MotoS3() as s3:
        url = f"s3://{s3.make_bucket()}/run"
        options = storage_options(s3.endpoint)
        run(url, 4, interval=2, storage_options=options)  # type: ignore[arg-type]
        rig, _ = resumed(url, interval=2, storage_options=options)  # type: ignore[arg-type]
        assert_same(snapshot(rig), reference[4])


def test_the_tiered_manager_does_the_work(tmp_path: Path, reference: Ref) -> None:
    fields = {"interval": 2, "manager": "tiered", "local_dir": str(tmp_path / "local"), "options": {"durable_every_n_steps": 4}}
    run(tmp_path / "durable", 4, **fields)
    assert committed_steps(tmp_path / "local") == [2, 4] and committed_steps(tmp_path / "durable") == [4]
    rig, _ = resumed(tmp_path / "durable", **fields)
    assert_same(snapshot(rig), reference[4])
