"""Hugging Face export and import with the real clients: a tiny Llama trained under our manager,
exported, and loaded by ``AutoModelForCausalLM.from_pretrained`` with equal logits; initial weights
from a Hugging Face directory; the export at save time (two ranks: tests/system/distributed/test_hf_export_ranks.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the [hf] extra, installed by scripts/venv.sh: never skipped
from safetensors import safe_open
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.cli import main as cli_main
from checkpoint_manager.formats import MissingConfigWarning, export_hf, load_hf_weights

VOCAB = 96


def llama_config(tie: bool = True) -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )


def tiny_llama(tie: bool = True, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(tie))


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))


def train_one_step(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = ids()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


def logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids()).logits


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """What a user keeps next to a model: config, tokenizer and generation config (and stray weights)."""
    art = tmp_path / "artifacts"
    llama_config().save_pretrained(art)
    transformers.GenerationConfig(max_new_tokens=5).save_pretrained(art)
    (art / "tokenizer.json").write_text('{"version": "1.0"}')
    (art / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (art / "pytorch_model.bin").write_bytes(b"not ours to copy")
    (art / "model.safetensors.index.json").write_text("{}")
    (art / ".cache").mkdir()
    (art / "subdir").mkdir()
    return art


def save_with_manager(model: nn.Module, save_dir: Path, **config: Any) -> Path:
    opt = train_one_step(model)
    state = TrainState()
    state.step = 1
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(save_dir), fsync=False, **config)) as mgr:
        result = mgr.save(SaveContext(model=model, optimizer=opt, train_state=state, force=True))
    assert result is not None
    return Path(result.path)


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in sorted(f.keys()):
                assert key not in out
                out[key] = f.get_tensor(key)
    return out


def test_export_loads_with_from_pretrained_with_equal_logits(tmp_path: Path, artifacts: Path) -> None:
    model = tiny_llama()
    ckpt = save_with_manager(model, tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf", artifacts_dir=artifacts)

    assert result.files == ("model.safetensors",)
    assert result.dropped == ("lm_head.weight",)  # tied to the embedding: transformers re-ties it
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))
    assert loaded.generation_config.max_new_tokens == 5

    # exactly the names and values transformers' own save_pretrained writes
    model.save_pretrained(tmp_path / "theirs")
    ours, theirs = file_tensors(tmp_path / "hf"), file_tensors(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharded_export_with_index(tmp_path: Path, artifacts: Path) -> None:
    model = tiny_llama()
    ckpt = save_with_manager(model, tmp_path / "ckpt")
    limit = 20_000
    result = export_hf(ckpt, tmp_path / "hf", artifacts_dir=artifacts, max_shard_size=limit)
    n = len(result.files)
    assert n > 1
    assert result.files == tuple(f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    tensors = file_tensors(tmp_path / "hf")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == result.bytes
    assert set(index["weight_map"]) == set(tensors)
    for file in result.files:
        with safe_open(tmp_path / "hf" / file, "pt") as f:
            keys = list(f.keys())
            assert all(index["weight_map"][k] == file for k in keys)
            size = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
            assert size <= limit or len(keys) == 1
    state = model.state_dict()
    for key, tensor in tensors.items():
        assert torch.equal(tensor, state[key]), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))


def test_bfloat16_export(tmp_path: Path, artifacts: Path) -> None:
    model = tiny_llama()
    ckpt = save_with_manager(model, tmp_path / "ckpt")
    export_hf(ckpt, tmp_path / "hf", artifacts_dir=artifacts, dtype="bfloat16")
    tensors = file_tensors(tmp_path / "hf")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    state = model.state_dict()
    assert all(torch.equal(t, state[k].bfloat16()) for k, t in tensors.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert "dtype" not in json.loads((artifacts / "config.json").read_text())  # the source is untouched
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    # the same as transformers casting its own fp32 save while loading
    model.save_pretrained(tmp_path / "theirs")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "theirs", dtype=torch.bfloat16)
    assert torch.equal(logits(loaded), logits(reference))


def test_untied_model_keeps_its_output_layer(tmp_path: Path) -> None:
    model = tiny_llama(tie=False)
    art = tmp_path / "art"
    llama_config(tie=False).save_pretrained(art)
    ckpt = save_with_manager(model, tmp_path / "ckpt")
    result = export_hf(ckpt, tmp_path / "hf", artifacts_dir=art)
    assert result.dropped == ()
    assert "lm_head.weight" in file_tensors(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(model))


def test_tied_weights_choices(tmp_path: Path, artifacts: Path) -> None:
    model = tiny_llama()
    ckpt = save_with_manager(model, tmp_path / "ckpt")
    kept = export_hf(ckpt, tmp_path / "keep", artifacts_dir=artifacts, tied_weights="keep")
    assert kept.dropped == () and "lm_head.weight" in file_tensors(tmp_path / "keep")
    recorded = export_hf(ckpt, tmp_path / "recorded")  # the config recorded at save time says they are tied
    assert recorded.dropped == ("lm_head.weight",) and (tmp_path / "recorded" / "config.json").is_file()
    (ckpt / "hf_config.json").unlink()  # as saved from a model without a .config
    with pytest.warns(MissingConfigWarning):
        no_config = export_hf(ckpt, tmp_path / "bare")  # without config.json nothing says they are tied
    assert no_config.dropped == () and not (tmp_path / "bare" / "config.json").exists()
    explicit = export_hf(ckpt, tmp_path / "explicit", tied_weights={"lm_head.weight": "model.embed_tokens.weight"})
    assert explicit.dropped == ("lm_head.weight",)
    assert kept.tensors == explicit.tensors + 1


def test_export_key_map_and_model_lists(tmp_path: Path) -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.llm = tiny_llama()

    a, b = Wrapper(), nn.Linear(3, 3)
    state = TrainState()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False)) as mgr:
        res = mgr.save(SaveContext(model=[a, b], train_state=state, force=True))
    assert res is not None
    with pytest.raises(CheckpointNotFoundError, match=r"no tensors under 'model'.*\['model_0', 'model_1'\]"):
        export_hf(res.path, tmp_path / "x")
    export_hf(res.path, tmp_path / "hf", model_key="model_0", key_map={"llm.": ""})
    assert set(file_tensors(tmp_path / "hf")) == set(a.llm.state_dict())
    export_hf(res.path, tmp_path / "lin", model_key="model_1", key_map=lambda k: None if k == "bias" else k)
    assert set(file_tensors(tmp_path / "lin")) == {"weight"}


def test_export_refuses_to_replace_unless_asked(tmp_path: Path) -> None:
    ckpt = save_with_manager(tiny_llama(), tmp_path / "ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    export_hf(ckpt, out)  # an empty directory is fine
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_hf(ckpt, out)
    (out / "model.safetensors").write_bytes(b"stale")
    export_hf(ckpt, out, overwrite=True)
    assert len(file_tensors(out)) == 20  # lm_head.weight left out: tied, as the recorded config says
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # nothing staged left over


def test_cli_export(tmp_path: Path, artifacts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_llama()
    ckpt = save_with_manager(model, tmp_path / "ckpt")
    rc = cli_main(["export", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf"), "--artifacts-dir", str(artifacts),
                   "--dtype", "bfloat16", "--max-shard-size", "30KB"])
    assert rc == 0
    assert "model-00001-of-" in capsys.readouterr().out
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    assert cli_main(["export", str(tmp_path / "nowhere"), "--to", "hf", "--out", str(tmp_path / "hf2")]) == 3
    assert f"{tmp_path / 'nowhere'}: no such file or directory" in capsys.readouterr().err  # missing, not corrupt


# -- at save time -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["every", "final"])
def test_save_consolidated(tmp_path: Path, artifacts: Path, mode: str) -> None:
    model = tiny_llama()
    opt = train_one_step(model)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "ckpt"), fsync=False, save_consolidated=mode,
                           artifacts_dir=str(artifacts), consolidated_dtype="bfloat16", max_shard_size="40KB")
    state = TrainState()
    with DefaultCheckpointManager(cfg) as mgr:
        state.step = 1
        first = mgr.save(SaveContext(model=model, optimizer=opt, train_state=state, force=True))
        train_one_step(model)
        state.step = 2
        last = mgr.save(SaveContext(model=model, optimizer=opt, train_state=state, final=True))
    assert first is not None and last is not None
    assert (Path(first.path) / "hf").is_dir() == (mode == "every")
    hf = Path(last.path) / "hf"
    assert (hf / "model.safetensors.index.json").is_file() and (hf / "tokenizer.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert loaded.dtype == torch.bfloat16
    state_dict = model.state_dict()
    assert all(torch.equal(t, state_dict[k].bfloat16()) for k, t in file_tensors(hf).items())
    # the checkpoint itself still resumes as usual
    fresh = tiny_llama(seed=3)
    with DefaultCheckpointManager(cfg) as mgr:
        assert mgr.load(LoadContext(model=fresh)).step == 2
    assert torch.equal(logits(fresh), logits(model))


def test_save_consolidated_never_by_default(tmp_path: Path) -> None:
    ckpt = save_with_manager(tiny_llama(), tmp_path / "ckpt")
    assert not (ckpt / "hf").exists()


# -- initial weights from a Hugging Face directory ----------------------------------------------------
def test_initial_load_path_from_hf_directory(tmp_path: Path) -> None:
    source = tiny_llama(seed=1)
    source.save_pretrained(tmp_path / "community")  # written by transformers itself
    model = tiny_llama(seed=2)
    opt = torch.optim.AdamW(model.parameters())
    state = TrainState()
    cfg = CheckpointConfig(save_dir=str(tmp_path / "run"), fsync=False, initial_load_path=str(tmp_path / "community"))
    with DefaultCheckpointManager(cfg) as mgr:
        ctx = LoadContext(model=model, optimizer=opt, train_state=state)
        assert mgr.should_load(ctx)
        result = mgr.load(ctx)
    assert result.step == 0 and result.restored == ("model",)
    assert result.skipped == ("optim", "train_state")
    assert result.bytes == sum(t.numel() * t.element_size() for k, t in source.state_dict().items()
                               if k != "lm_head.weight")
    assert torch.equal(logits(model), logits(source))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert state.step == 0


def test_initial_load_key_map_for_a_wrapped_model(tmp_path: Path) -> None:
    class Wrapper(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.llm = tiny_llama(seed=seed)
            self.head = nn.Linear(4, 4)

    tiny_llama(seed=1).save_pretrained(tmp_path / "community")
    wrapped = Wrapper(seed=2)
    head_before = wrapped.head.weight.detach().clone()
    cfg = CheckpointConfig(save_dir=str(tmp_path / "run"), fsync=False, initial_load_path=str(tmp_path / "community"))
    with DefaultCheckpointManager(cfg) as mgr, \
            pytest.raises(CheckpointMismatchError, match=r"missing in the files \[llm\.model\.embed_tokens"):
        mgr.load(LoadContext(model=wrapped))
    cfg.initial_load_key_map = {"": "llm."}
    with DefaultCheckpointManager(cfg) as mgr, \
            pytest.raises(CheckpointMismatchError, match=r"missing in the files \[head.weight, head.bias\]"):
        mgr.load(LoadContext(model=wrapped))
    with DefaultCheckpointManager(cfg) as mgr:
        mgr.load(LoadContext(model=wrapped, strict=False))
    assert torch.equal(logits(wrapped.llm), logits(tiny_llama(seed=1)))
    assert torch.equal(wrapped.head.weight, head_before)


def test_load_hf_weights_errors(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointMismatchError, match=r"shape \(96, 32\) in the file, \(50, 32\) in the model"):
        bigger = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**{**llama_config().to_dict(), "vocab_size": 50})
        )
        load_hf_weights(bigger, tmp_path / "hf")
    with pytest.raises(CheckpointMismatchError, match=r"missing in the files \[model.norm.weight\] \(1\), not in the model \[norm_renamed\]"):
        load_hf_weights(tiny_llama(), tmp_path / "hf",
                        key_map=lambda k: "norm_renamed" if k == "model.norm.weight" else k)
    with pytest.raises(CheckpointNotFoundError, match="not a Hugging Face model directory"):
        load_hf_weights(tiny_llama(), tmp_path)
    report = load_hf_weights(tiny_llama(seed=5), tmp_path / "hf" / "model.safetensors")
    assert report.tied == ("lm_head.weight",) and report.missing == () and len(report.loaded) == 20
