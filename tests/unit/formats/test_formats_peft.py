"""PEFT adapter export: the adapter of a trained LoRA model, taken from our checkpoint, loads with
``PeftModel.from_pretrained`` and reproduces the trained model's outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import peft  # the [hf] extra, installed by scripts/venv.sh: never skipped
import pytest
import torch
import transformers
from safetensors import safe_open

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointMismatchError,
    DefaultCheckpointManager,
    SaveContext,
    TrainState,
)
from checkpoint_manager.formats import export_peft_adapter


def tiny_base(seed: int = 0) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def lora_config() -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Any, Path, torch.Tensor]:
    """A LoRA model after two AdamW steps (so lora_B is no longer zero), saved by the manager."""
    model = peft.get_peft_model(tiny_base(), lora_config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    state = TrainState()
    state.step = 2
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False)) as mgr:
        result = mgr.save(SaveContext(model=model, optimizer=opt, train_state=state, force=True))
    assert result is not None
    return model, Path(result.path), ids


def test_adapter_export_loads_with_peft_and_gives_equal_outputs(trained: Any, tmp_path: Path) -> None:
    model, ckpt, ids = trained
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    out = tmp_path / "adapter"
    result = export_peft_adapter(ckpt, out, model)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    loaded = peft.PeftModel.from_pretrained(tiny_base(), str(out))
    loaded.eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, expected)
    # and the adapter matters: the base model alone answers differently
    with torch.no_grad():
        assert not torch.equal(tiny_base()(input_ids=ids).logits, expected)

    full = sum(f.stat().st_size for f in ckpt.iterdir() if f.name.endswith(".distcp"))
    assert (out / "adapter_model.safetensors").stat().st_size * 20 < full
    assert result.bytes == sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n
    )


def test_adapter_matches_what_peft_itself_saves(trained: Any, tmp_path: Path) -> None:
    model, ckpt, _ = trained
    export_peft_adapter(ckpt, tmp_path / "ours", model)
    model.save_pretrained(str(tmp_path / "peft"))
    with safe_open(tmp_path / "ours" / "adapter_model.safetensors", "pt") as ours, \
            safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        assert len(list(ours.keys())) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
        for key in sorted(ours.keys()):
            assert torch.equal(ours.get_tensor(key), theirs.get_tensor(key)), key
    ours_cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    theirs_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    # peft keeps target_modules as a set: the order it writes them in varies from run to run
    for cfg in (ours_cfg, theirs_cfg):
        cfg["target_modules"] = sorted(cfg["target_modules"])
    assert ours_cfg == theirs_cfg
    assert ours_cfg["target_modules"] == ["q_proj", "v_proj"]
    assert ours_cfg["inference_mode"] is True
    assert model.peft_config["default"].inference_mode is False  # the live config is untouched


def test_weights_come_from_the_checkpoint_not_the_live_model(trained: Any, tmp_path: Path) -> None:
    model, ckpt, ids = trained
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.zero_()  # training moved on (or the live model is fresh): the file must not care
    export_peft_adapter(ckpt, tmp_path / "adapter", model)
    loaded = peft.PeftModel.from_pretrained(tiny_base(), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)


def test_config_only_export_picks_the_same_tensors(trained: Any, tmp_path: Path) -> None:
    model, ckpt, ids = trained
    export_peft_adapter(ckpt, tmp_path / "by_model", model)
    export_peft_adapter(ckpt, tmp_path / "by_config", lora_config())
    with safe_open(tmp_path / "by_model" / "adapter_model.safetensors", "pt") as a, \
            safe_open(tmp_path / "by_config" / "adapter_model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in sorted(a.keys()):
            assert torch.equal(a.get_tensor(key), b.get_tensor(key))
    model.eval()
    loaded = peft.PeftModel.from_pretrained(tiny_base(), str(tmp_path / "by_config")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_bfloat16_adapter(trained: Any, tmp_path: Path) -> None:
    model, ckpt, _ = trained
    export_peft_adapter(ckpt, tmp_path / "bf16", model, dtype="bfloat16")
    with safe_open(tmp_path / "bf16" / "adapter_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in sorted(f.keys())} == {torch.bfloat16}


def test_errors(trained: Any, tmp_path: Path) -> None:
    model, ckpt, _ = trained
    with pytest.raises(ValueError, match="not a PEFT model with adapter 'other'"):
        export_peft_adapter(ckpt, tmp_path / "x", model, adapter_name="other")
    with pytest.raises(ValueError, match="not a PEFT model"):
        export_peft_adapter(ckpt, tmp_path / "x", torch.nn.Linear(2, 2))
    # a checkpoint of a model without adapters
    plain = tiny_base()
    state = TrainState()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "plain"), fsync=False)) as mgr:
        res = mgr.save(SaveContext(model=plain, train_state=state, force=True))
    assert res is not None
    with pytest.raises(CheckpointMismatchError, match="holds no tensors of adapter 'default'"):
        export_peft_adapter(res.path, tmp_path / "y", lora_config())
    export_peft_adapter(ckpt, tmp_path / "z", model)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_peft_adapter(ckpt, tmp_path / "z", model)
    export_peft_adapter(ckpt, tmp_path / "z", model, overwrite=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
