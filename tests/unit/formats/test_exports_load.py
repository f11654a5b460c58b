"""Exports that load: the Hugging Face config recorded at save time, LoRA merged or exported as an
adapter, tied weights understood by ``ckpt diff``, and the HF Trainer's metrics kept to the model's.

Real transformers and peft models built from tiny configs (no download); every comparison of
outputs is exact where the arithmetic is the same, and states its tolerance where it is not.
"""

from __future__ import annotations

import json
import re
import warnings
import zlib
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointMismatchError,
    DefaultCheckpointManager,
    MissingConfigWarning,
    SaveContext,
    TrainState,
    UnsupportedAdapterError,
    export_peft,
)
from checkpoint_manager.cli import main as cli_main
from checkpoint_manager.core.integrity import verify
from checkpoint_manager.formats import export_hf

transformers.logging.set_verbosity_error()

VOCAB = 96


def llama_config(tie: bool = True) -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )


def tiny_llama(tie: bool = True, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(tie))


def gpt2_config() -> Any:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )


def tiny_gpt2(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(gpt2_config())


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))


def logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids()).logits  # type: ignore[no-any-return]


def train_steps(model: nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    """A few AdamW steps on the trainable parameters (for LoRA: lora_B leaves zero)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = ids()
    for _ in range(steps):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def save(model: nn.Module, save_dir: Path, step: int = 1, **config: Any) -> Path:
    state = TrainState()
    state.step = step
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False, **config)) as mgr:
        result = mgr.save(SaveContext(model=model, train_state=state, force=True))
    assert result is not None
    return Path(result.path)


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = f.get_tensor(key)
    return out


@pytest.fixture(autouse=True)
def _missing_config_is_an_error() -> Any:
    """An export that should have found a config and warns instead fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingConfigWarning)
        yield


# -- 1. the config recorded at save time ---------------------------------------------------------------
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_export_without_artifacts_loads_with_equal_logits(tmp_path: Path, build: Any) -> None:
    model = build()
    ckpt = save(model, tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf")
    assert result.config == "checkpoint"
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]
    assert result.dropped == ("lm_head.weight",)  # tied: the recorded config says so
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(loaded) is type(model)
    assert torch.equal(logits(loaded), logits(model))
    # the config is what save_pretrained writes (architectures and dtype set), the generation config too
    model.save_pretrained(tmp_path / "theirs")
    ours = json.loads((tmp_path / "hf" / "config.json").read_text())
    theirs = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert ours == theirs
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == json.loads(
        (tmp_path / "theirs" / "generation_config.json").read_text()
    )


def test_recorded_config_is_a_checked_json_file_of_the_checkpoint(tmp_path: Path) -> None:
    ckpt = save(tiny_llama(), tmp_path / "ckpt")
    raw = (ckpt / "hf_config.json").read_bytes()
    data = json.loads(raw)
    assert data["format"] == "checkpoint-manager-hf-config" and data["version"] == 1
    assert data["models"]["model"]["config"]["model_type"] == "llama"
    files = json.loads((ckpt / "checkpoint.json").read_text())["files"]
    assert files["hf_config.json"] == {"size": len(raw), "crc32": zlib.crc32(raw)}
    assert verify(ckpt, "full") == []
    (ckpt / "hf_config.json").write_bytes(raw.replace(b"llama", b"llamb"))
    altered = zlib.crc32((ckpt / "hf_config.json").read_bytes())
    assert verify(ckpt, "full") == [
        f"{ckpt / 'hf_config.json'}: CRC32 {altered:08x}, checkpoint.json records {zlib.crc32(raw):08x} (corrupted)"
    ]


def test_cast_export_records_the_dtype(tmp_path: Path) -> None:
    model = tiny_llama()
    ckpt = save(model, tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf", dtype="bfloat16")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "theirs")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "theirs", dtype=torch.bfloat16)
    assert torch.equal(logits(loaded), logits(reference))


def test_artifacts_config_wins_and_tokenizer_files_join_the_recorded_one(tmp_path: Path) -> None:
    art = tmp_path / "art"
    art.mkdir()
    (art / "tokenizer.json").write_text('{"version": "1.0"}')
    ckpt = save(tiny_llama(), tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf", artifacts_dir=art)  # no config.json in art: the recorded one
    assert result.config == "checkpoint"
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    ]
    llama_config().save_pretrained(art)
    with_art = export_hf(ckpt, tmp_path / "hf2", artifacts_dir=art)
    assert with_art.config == "artifacts_dir"
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == json.loads((art / "config.json").read_text())


def test_config_changed_during_the_run_is_recorded_anew(tmp_path: Path) -> None:
    model = tiny_llama(tie=False)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False)
    state = TrainState()
    with DefaultCheckpointManager(cfg) as mgr:
        state.step = 1
        first = mgr.save(SaveContext(model=model, train_state=state, force=True))
        model.resize_token_embeddings(VOCAB + 8)
        state.step = 2
        second = mgr.save(SaveContext(model=model, train_state=state, force=True))
    assert first is not None and second is not None
    for result, vocab in ((first, VOCAB), (second, VOCAB + 8)):
        recorded = json.loads((Path(result.path) / "hf_config.json").read_text())
        assert recorded["models"]["model"]["config"]["vocab_size"] == vocab
    export_hf(second.path, tmp_path / "hf")
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(model))


def test_async_save_records_the_config(tmp_path: Path) -> None:
    model = tiny_llama()
    cfg = CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False, async_save=True)
    with DefaultCheckpointManager(cfg) as mgr:
        mgr.save(SaveContext(model=model, train_state=TrainState(), force=True))
        mgr.finalize_async_saves(blocking=True)
        ckpt = Path(mgr.list_checkpoints()[-1].path)
    export_hf(ckpt, tmp_path / "hf")
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(model))


def test_no_config_known_warns_in_the_api_and_says_so_in_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = save(nn.Linear(4, 3), tmp_path / "ckpt")
    assert not (ckpt / "hf_config.json").exists()
    with pytest.warns(MissingConfigWarning, match=r"written without config\.json .* pass artifacts_dir="):
        result = export_hf(ckpt, tmp_path / "hf")
    assert result.config is None
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    capsys.readouterr()
    assert cli_main(["export", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf2")]) == 0
    out = capsys.readouterr().out
    assert "no config.json written" in out and "--artifacts-dir" in out
    assert cli_main(["export", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf3"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"] is None and any("no config.json" in n for n in doc["notes"])


def test_a_bundle_carries_the_recorded_config(tmp_path: Path) -> None:
    from checkpoint_manager.formats import pack_bundle

    model = tiny_llama()
    bundle = pack_bundle(save(model, tmp_path / "ckpt"), tmp_path / "model.tar")
    export_hf(bundle, tmp_path / "hf")
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(model))


@pytest.mark.timeout(60)
def test_a_damaged_or_hostile_recorded_config_is_a_typed_error(tmp_path: Path) -> None:
    import os

    from checkpoint_manager import CheckpointCorruptError, UnsafeCheckpointError

    ckpt = save(tiny_llama(), tmp_path / "ckpt")
    (ckpt / "hf_config.json").write_text('{"format": "checkpoint-manager-hf-config", "models": {"model": []}}')
    with pytest.raises(CheckpointCorruptError, match=r"hf_config\.json: 'model' is not a JSON object"):
        export_hf(ckpt, tmp_path / "hf")
    (ckpt / "hf_config.json").write_bytes(b"\xff{")
    with pytest.raises(CheckpointCorruptError, match=r"hf_config\.json: not valid JSON"):
        export_hf(ckpt, tmp_path / "hf")
    (ckpt / "hf_config.json").unlink()
    os.mkfifo(ckpt / "hf_config.json")  # an open would block forever
    with pytest.raises(UnsafeCheckpointError, match=r"hf_config\.json: is not a regular file \(a FIFO\)"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


class BrokenConfig:
    """Looks like a Hugging Face config but cannot be serialized."""

    def to_dict(self) -> dict[str, Any]:
        raise RuntimeError("cannot serialize")

    def to_json_string(self, use_diff: bool = True) -> str:
        raise RuntimeError("cannot serialize")


def test_a_config_that_cannot_be_recorded_never_fails_the_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Linear(4, 3)
    model.config = BrokenConfig()  # type: ignore[assignment]
    with caplog.at_level("WARNING", logger="checkpoint_manager"):
        ckpt = save(model, tmp_path / "ckpt")
    assert not (ckpt / "hf_config.json").exists()
    assert "not recording the Hugging Face config of model: RuntimeError('cannot serialize')" in caplog.text
    assert verify(ckpt, "full") == []


def test_lists_of_models_record_each_config(tmp_path: Path) -> None:
    llama, gpt2 = tiny_llama(), tiny_gpt2()
    state = TrainState()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False)) as mgr:
        result = mgr.save(SaveContext(model=[llama, nn.Linear(2, 2), gpt2], train_state=state, force=True))
    assert result is not None
    models = json.loads((Path(result.path) / "hf_config.json").read_text())["models"]
    assert sorted(models) == ["model_0", "model_2"]
    export_hf(result.path, tmp_path / "gpt2", model_key="model_2")
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")), logits(gpt2))


# -- 2. LoRA: refused as is, merged, or exported as an adapter --------------------------------------------
def lora_model(base: Any, **config: Any) -> Any:
    options: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                               "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    options.update(config)
    model = peft.get_peft_model(base, peft.LoraConfig(**options))
    train_steps(model)
    return model


def assert_merged_export_matches(model: Any, out: Path, base_names: set[str]) -> None:
    """The export loads with from_pretrained under the base names and answers as PEFT's merge."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert set(file_tensors(out)) <= base_names
    with_adapter = logits(model)
    merged_by_peft = model.merge_and_unload()
    assert torch.equal(logits(loaded), logits(merged_by_peft))  # the same arithmetic as PEFT's merge
    # and the same model as the adapter-carrying one (x·W + s·x·A·B vs x·(W + s·B·A): rounding only)
    assert torch.allclose(logits(loaded), with_adapter, rtol=0, atol=1e-5)


def test_plain_hf_export_of_a_lora_checkpoint_is_refused_naming_both_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = save(lora_model(tiny_llama()), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"holds PEFT adapter tensors \(base_model\.model\.model\.layers\.0\."
                       r"self_attn\.q_proj\.lora_A\.default\.weight, \.\.\.\).*merge_lora=True; ckpt export "
                       r"--to hf --merge-lora\).*export_peft; ckpt export --to peft\)"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert cli_main(["export", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "--merge-lora" in err and "--to peft" in err
    assert not (tmp_path / "hf").exists()


def test_a_model_of_its_own_with_lora_named_layers_is_not_taken_for_peft(tmp_path: Path) -> None:
    class OwnLora(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lora_A = nn.Linear(4, 2, bias=False)
            self.lora_B = nn.Linear(2, 4, bias=False)

    ckpt = save(OwnLora(), tmp_path / "ckpt")
    with pytest.warns(MissingConfigWarning):
        result = export_hf(ckpt, tmp_path / "hf")
    assert sorted(file_tensors(tmp_path / "hf")) == ["lora_A.weight", "lora_B.weight"] and result.merged == 0


def test_merge_lora_gives_the_base_model_with_the_adapter_folded_in(tmp_path: Path) -> None:
    model = lora_model(tiny_llama())
    ckpt = save(model, tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf", merge_lora=True)
    assert result.merged_adapter == "default" and result.merged == 4  # q_proj, v_proj of 2 layers
    assert result.config == "checkpoint" and result.dropped == ("lm_head.weight",)
    base_names = set(tiny_llama().state_dict())
    assert set(file_tensors(tmp_path / "hf")) == base_names - {"lm_head.weight"}
    assert_merged_export_matches(model, tmp_path / "hf", base_names)


def test_cli_merge_lora_and_peft_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = lora_model(tiny_llama())
    ckpt = save(model, tmp_path / "ckpt")
    expected = logits(model)
    assert cli_main(["export", str(ckpt), "--to", "peft", "--out", str(tmp_path / "adapter")]) == 0
    assert "adapter_model.safetensors" in capsys.readouterr().out
    restored = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "adapter"))
    assert torch.equal(logits(restored), expected)
    assert cli_main(["export", str(ckpt), "--to", "hf", "--merge-lora", "--out", str(tmp_path / "hf")]) == 0
    assert "merged LoRA adapter 'default' into 4 weight(s)" in capsys.readouterr().out
    assert cli_main(["export", str(ckpt), "--to", "peft", "--merge-lora", "--out", str(tmp_path / "x")]) == 2
    assert "--merge-lora and --adapter-config go with --to hf" in capsys.readouterr().err
    assert cli_main(["export", str(ckpt), "--to", "hf", "--adapter-name", "default", "--out", str(tmp_path / "x")]) == 2
    assert "go with --merge-lora" in capsys.readouterr().err
    assert_merged_export_matches(model, tmp_path / "hf", set(tiny_llama().state_dict()))


def test_export_peft_from_the_checkpoint_alone(tmp_path: Path) -> None:
    model = lora_model(tiny_llama(tie=False), modules_to_save=["lm_head"])
    ckpt = save(model, tmp_path / "ckpt")
    expected = logits(model)
    result = export_peft(ckpt, tmp_path / "adapter")
    model.save_pretrained(tmp_path / "theirs")  # what PEFT itself writes
    assert set(file_tensors(tmp_path / "adapter")) == set(file_tensors(tmp_path / "theirs"))
    assert set(result.tensors) == set(file_tensors(tmp_path / "theirs"))
    ours = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    theirs = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    for config in (ours, theirs):  # PEFT keeps target_modules as a set: its JSON order varies by run
        config["target_modules"] = sorted(config["target_modules"])
    assert ours == theirs
    restored = peft.PeftModel.from_pretrained(tiny_llama(tie=False), str(tmp_path / "adapter"))
    assert torch.equal(logits(restored), expected)


def test_merge_with_modules_to_save(tmp_path: Path) -> None:
    model = lora_model(tiny_llama(tie=False), modules_to_save=["lm_head"])
    ckpt = save(model, tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf", merge_lora=True)
    base_names = set(tiny_llama(tie=False).state_dict())
    assert set(file_tensors(tmp_path / "hf")) == base_names
    trained_head = model.base_model.model.lm_head.modules_to_save["default"].weight
    assert torch.equal(file_tensors(tmp_path / "hf")["lm_head.weight"], trained_head.detach())
    assert_merged_export_matches(model, tmp_path / "hf", base_names)


def test_merge_fan_in_fan_out_conv1d_of_gpt2(tmp_path: Path) -> None:
    model = lora_model(tiny_gpt2(), target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    ckpt = save(model, tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf", merge_lora=True)
    assert result.merged == 6  # c_attn and the attention's and MLP's c_proj, 2 layers
    assert_merged_export_matches(model, tmp_path / "hf", set(tiny_gpt2().state_dict()))


def test_merge_rslora_with_rank_and_alpha_patterns_and_embedding(tmp_path: Path) -> None:
    model = lora_model(
        tiny_llama(tie=False),
        target_modules=["q_proj", "v_proj", "embed_tokens"],
        use_rslora=True,
        rank_pattern={"layers.1.self_attn.q_proj": 2},
        alpha_pattern={"v_proj": 3},
    )
    ckpt = save(model, tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf", merge_lora=True)
    assert result.merged == 5
    assert_merged_export_matches(model, tmp_path / "hf", set(tiny_llama(tie=False).state_dict()))


def test_merge_lora_bias(tmp_path: Path) -> None:
    model = lora_model(tiny_gpt2(), target_modules=["c_attn"], fan_in_fan_out=True, lora_bias=True)
    ckpt = save(model, tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf", merge_lora=True)
    assert result.merged == 4  # weight and bias of c_attn, 2 layers
    assert_merged_export_matches(model, tmp_path / "hf", set(tiny_gpt2().state_dict()))


def test_merge_in_bfloat16_matches_peft(tmp_path: Path) -> None:
    model = lora_model(tiny_llama()).to(torch.bfloat16)
    ckpt = save(model, tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf", merge_lora=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    merged = model.merge_and_unload()
    ours = file_tensors(tmp_path / "hf")
    for name, tensor in merged.state_dict().items():
        if name in ours:
            assert torch.equal(ours[name], tensor), name


def test_dora_and_other_methods_are_refused_with_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dora = save(lora_model(tiny_llama(), use_dora=True), tmp_path / "dora")
    with pytest.raises(UnsupportedAdapterError, match=r"adapter 'default' uses DoRA \(use_dora=True\), whose "
                       r"merge is not W \+ scale·B·A: export it as an adapter instead"):
        export_hf(dora, tmp_path / "hf", merge_lora=True)
    assert cli_main(["export", str(dora), "--to", "hf", "--merge-lora", "--out", str(tmp_path / "hf")]) == 2
    assert "uses DoRA" in capsys.readouterr().err
    ia3 = peft.get_peft_model(tiny_llama(), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                           feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    ia3_ckpt = save(ia3, tmp_path / "ia3")
    with pytest.raises(UnsupportedAdapterError, match="adapter 'default' is a IA3 adapter: only LoRA adapters"):
        export_hf(ia3_ckpt, tmp_path / "hf", merge_lora=True)
    with pytest.raises(ValueError, match="holds PEFT adapter tensors"):
        export_hf(ia3_ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    export_peft(ia3_ckpt, tmp_path / "ia3_adapter")  # the adapter itself exports fine
    restored = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "ia3_adapter"))
    assert torch.equal(logits(restored), logits(ia3))


def test_merge_lora_of_a_plain_checkpoint_and_adapter_config_given(tmp_path: Path) -> None:
    plain = save(tiny_llama(), tmp_path / "plain")
    with pytest.raises(CheckpointMismatchError, match="holds no PEFT adapter under 'model' to merge"):
        export_hf(plain, tmp_path / "hf", merge_lora=True)
    model = lora_model(tiny_llama(), lora_alpha=16)
    ckpt = save(model, tmp_path / "ckpt")
    (ckpt / "hf_config.json").unlink()  # as an older version saved it: no config recorded
    with pytest.raises(ValueError, match=r"recorded no PEFT adapter config .* pass adapter_config="):
        export_hf(ckpt, tmp_path / "hf", merge_lora=True)
    model.save_pretrained(tmp_path / "adapter_files")
    with pytest.warns(MissingConfigWarning):
        export_hf(ckpt, tmp_path / "hf", merge_lora=True, adapter_config=tmp_path / "adapter_files")
    llama_config().save_pretrained(tmp_path / "hf")  # the config it lacked
    assert_merged_export_matches(model, tmp_path / "hf", set(tiny_llama().state_dict()))


def test_save_consolidated_of_a_lora_model_is_the_merged_model(tmp_path: Path) -> None:
    model = lora_model(tiny_llama())
    ckpt = save(model, tmp_path / "ckpt", save_consolidated="every")
    assert verify(ckpt, "full") == []
    assert_merged_export_matches(model, ckpt / "hf", set(tiny_llama().state_dict()))


def test_save_consolidated_of_a_dora_model_skips_the_export_not_the_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = lora_model(tiny_llama(), use_dora=True)
    with caplog.at_level("WARNING", logger="checkpoint_manager"):
        ckpt = save(model, tmp_path / "ckpt", save_consolidated="every")
    assert not (ckpt / "hf").exists() and verify(ckpt, "full") == []
    assert re.search(r"save_consolidated: not exporting model of step_00000001\.\w+ \(pending\): adapter "
                     r"'default' uses DoRA", caplog.text)


# -- 3. ckpt diff understands tied weights ----------------------------------------------------------------
def test_diff_of_a_checkpoint_and_its_export_reports_tied_not_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = tmp_path / "art"
    llama_config().save_pretrained(art)
    ckpt = save(tiny_llama(), tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf", artifacts_dir=art)
    capsys.readouterr()
    assert cli_main(["diff", str(ckpt), str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "= lm_head.weight  (only in A: tied to model.embed_tokens.weight, equal)" in out
    assert "equal: 20 tensor(s) compared, 20 equal" in out and "0 only in A, 0 only in B, 1 tied" in out
    assert cli_main(["diff", str(tmp_path / "hf"), str(ckpt), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is True and doc["missing"] == [] and doc["extra"] == []
    assert doc["tied"] == [{"name": "lm_head.weight", "tied_to": "model.embed_tokens.weight", "only_in": "B",
                            "equal": True, "max_abs_diff": 0.0, "differing_elements": 0}]


def test_diff_with_the_recorded_config_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = save(tiny_gpt2(), tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").unlink()  # only the checkpoint's recorded config says what is tied
    capsys.readouterr()
    assert cli_main(["diff", str(ckpt), str(tmp_path / "hf")]) == 0
    assert "= lm_head.weight  (only in A: tied to transformer.wte.weight, equal)" in capsys.readouterr().out


def test_diff_reports_a_tied_copy_that_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = tmp_path / "art"
    llama_config(tie=True).save_pretrained(art)  # says tied, but the saved model was not
    ckpt = save(tiny_llama(tie=False), tmp_path / "ckpt")
    (ckpt / "hf_config.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf(ckpt, tmp_path / "hf", artifacts_dir=art)
    capsys.readouterr()
    assert cli_main(["diff", str(ckpt), str(tmp_path / "hf")]) == 1
    out = capsys.readouterr().out
    assert "! lm_head.weight  (only in A: tied to model.embed_tokens.weight, which differs: max |a-b|" in out
    assert out.splitlines()[-1].startswith("DIFFERENT")


# -- 4. HF Trainer: the final save records the model's metrics, not the run summary -------------------------
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x) - labels).pow(2).mean()}


def test_trainer_final_save_keeps_only_the_step_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from checkpoint_manager.integrations import HFCheckpointCallback

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    data = [{"x": x[i], "labels": y[i]} for i in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=1, dataloader_num_workers=0,
    )
    cfg = CheckpointConfig(save_dir=str(tmp_path / "ckpt"), save_every_n_steps=3, fsync=False)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[HFCheckpointCallback(cfg)])
    trainer.remove_callback(PrinterCallback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    final = json.loads((tmp_path / "ckpt" / "step_00000004" / "checkpoint.json").read_text())
    assert sorted(final["metrics"]) == ["epoch", "grad_norm", "learning_rate", "loss"]
    logged = next(e for e in trainer.state.log_history if e.get("step") == 4 and "loss" in e)
    assert final["metrics"]["loss"] == logged["loss"]
    assert any("train_runtime" in e for e in trainer.state.log_history)  # the summary was logged, not saved
    capsys.readouterr()
    assert cli_main(["list", str(tmp_path / "ckpt")]) == 0
    assert "train_runtime" not in capsys.readouterr().out
