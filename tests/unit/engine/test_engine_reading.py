"""Every engine's checkpoints get the whole product: ``ckpt``, the exports, bundles, conversions and
``save_consolidated`` read them through the engine that wrote them.

The same checks run on checkpoints of the DCP engine, both plugin engines (``safetensors``,
``torch_checkpointing``) and the worked engine of ``docs/writing-an-engine.md`` (installed the way a
package installs one: an entry point, here a ``.dist-info`` directory on ``sys.path``). Real tiny
transformers and peft models; Hugging Face exports load with ``from_pretrained`` and give the logits
of the model that was saved.
"""

from __future__ import annotations

import importlib
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    convert,
    export_hf,
    export_peft,
    pack_bundle,
)
from checkpoint_manager.cli import main
from checkpoint_manager.core.layout import read_checkpoint_json
from checkpoint_manager.engine.base import Engine, EngineContext, TensorInfo
from checkpoint_manager.engine.reading import IndexReader, open_directory
from checkpoint_manager.formats.bundle import read_bundle_metadata
from tests.helpers.process import ROOT
from tests.system.docs.test_docs import extract_blocks

transformers.logging.set_verbosity_error()

ENGINES = ["dcp", "safetensors", "torch_checkpointing", "raw"]
DOC = ROOT / "docs" / "writing-an-engine.md"
VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def raw_engine_installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The page's engine as a package installs it: a module and an entry point named ``raw``."""
    root = tmp_path_factory.mktemp("site")
    source = next(b.source for b in extract_blocks(DOC.read_text(encoding="utf-8")) if "class RawEngine" in b.source)
    (root / "docs_raw_engine.py").write_text(source, encoding="utf-8")
    info = root / "docs_raw_engine-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: docs-raw-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[checkpoint_manager.engines]\nraw = docs_raw_engine:RawEngine\n")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("docs_raw_engine", None)
        importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def _private_bundle_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECKPOINT_MANAGER_CACHE", str(tmp_path / "cache"))


def tiny_llama(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))


def logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids()).logits  # type: ignore[no-any-return]


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = ids()
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def run(save_dir: Path, engine: str, **config: Any) -> tuple[Any, torch.optim.Optimizer, list[Path]]:
    """Two committed checkpoints (steps 1 and 2) of a tiny llama with AdamW, written by ``engine``."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    paths: list[Path] = []
    cfg = CheckpointConfig(save_dir=str(save_dir), engine=engine, fsync=False, **config)
    with DefaultCheckpointManager(cfg) as manager:
        for step in (1, 2):
            train(model, opt)
            result = manager.save(
                SaveContext(model=model, optimizer=opt, train_state=TrainState(step=step), force=True,
                            final=step == 2, metrics={"loss": 1.0 / step})
            )
            assert result is not None and result.committed
            paths.append(Path(result.path))
    assert read_checkpoint_json(paths[-1])["engine"] == engine
    return model, opt, paths


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main(["--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def live_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What a checkpoint of ``model`` and ``opt`` holds as tensors, by key."""
    out = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in opt.state.items():
        for slot, value in state.items():
            out[f"optim.state.{names[id(param)]}.{slot}"] = value
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_every_ckpt_command_reads_every_engine(engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt, (first, newest) = run(tmp_path / "run", engine)
    live = live_tensors(model, opt)

    code, doc = cli(capsys, "list", str(tmp_path / "run"))
    assert code == 0 and [c["step"] for c in doc["checkpoints"]] == [1, 2]
    code, doc = cli(capsys, "inspect", str(tmp_path / "run"))
    assert code == 0 and doc["meta"]["engine"] == engine and doc["kind"] == "checkpoint"
    listed = {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in doc["tensors"]}
    assert listed == {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in live.items()}
    assert doc["summary"]["parameters"] == sum(p.numel() for p in model.parameters())

    assert cli(capsys, "verify", str(newest), "--finite")[0] == 0
    code, doc = cli(capsys, "diff", str(newest), str(newest))
    assert code == 0 and doc["equal"] and doc["compared"] == len(live)
    code, doc = cli(capsys, "diff", str(first), str(newest), "--filter", "model.*")
    assert code == 1 and doc["different"]  # one training step apart

    code, doc = cli(capsys, "export", str(newest), "--to", "safetensors", "--out", str(tmp_path / "w.safetensors"))
    assert code == 0 and doc["tensors"] == len(model.state_dict())
    weights = load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    code, doc = cli(capsys, "export", str(newest), "--to", "torch", "--out", str(tmp_path / "w.pt"))
    assert code == 0
    saved = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    code, doc = cli(capsys, "export", str(newest), "--to", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(model))
    code, doc = cli(capsys, "diff", str(newest), str(tmp_path / "hf"))
    assert code == 0 and doc["equal"], doc

    code, doc = cli(capsys, "convert", str(newest), str(tmp_path / "c.safetensors"), "--to", "safetensors")
    assert code == 0 and load_file(str(tmp_path / "c.safetensors")).keys() == model.state_dict().keys()

    code, doc = cli(capsys, "pack", str(newest), str(tmp_path / "b.tar"))
    assert code == 0
    code, doc = cli(capsys, "inspect", str(tmp_path / "b.tar"))
    assert code == 0 and {t["name"] for t in doc["tensors"]} == set(live)
    code, doc = cli(capsys, "unpack", str(tmp_path / "b.tar"), str(tmp_path / "unpacked"))
    assert code == 0
    code, doc = cli(capsys, "diff", str(tmp_path / "unpacked"), str(newest))
    assert code == 0 and doc["equal"]
    code, doc = cli(capsys, "export", str(tmp_path / "b.tar"), "--to", "safetensors", "--out", str(tmp_path / "b.safetensors"))
    assert code == 0 and load_file(str(tmp_path / "b.safetensors")).keys() == model.state_dict().keys()
    code, doc = cli(capsys, "cache", "list")
    assert code == 0 and len(doc["entries"]) == 1
    code, doc = cli(capsys, "prune", str(tmp_path / "run"), "--keep-last", "1", "--dry-run")
    assert code == 0 and [d["name"] for d in doc["deleted"]] == [first.name]


@pytest.mark.parametrize("engine", ENGINES)
def test_convert_to_dcp_and_back_keeps_the_whole_state(engine: str, tmp_path: Path) -> None:
    model, opt, (_, newest) = run(tmp_path / "run", engine)
    other = "safetensors" if engine == "dcp" else "dcp"
    assert main(["convert", str(newest), str(tmp_path / "there"), "--to", "dcp", "--engine", other]) == 0
    back = convert(tmp_path / "there", tmp_path / "back", to="dcp", engine=engine)
    for converted, name in ((tmp_path / "there", other), (back, engine)):
        meta = read_checkpoint_json(converted)
        assert (meta["engine"], meta["step"], meta["world_size"]) == (name, 2, 1)
        assert meta["train_state"]["step"] == 2 and meta["metrics"] == {"loss": 0.5}
        assert main(["verify", str(converted)]) == 0
        # a training run resumes from it bit for bit: weights, optimizer state, step
        fresh = tiny_llama(seed=1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        state = TrainState()
        cfg = CheckpointConfig(save_dir=str(tmp_path / f"resume-{name}"), engine=engine, fsync=False)
        with DefaultCheckpointManager(cfg) as manager:
            result = manager.load(LoadContext(model=fresh, optimizer=fresh_opt, train_state=state, path=str(converted)))
        assert result.step == 2 and state.step == 2
        expected, got = live_tensors(model, opt), live_tensors(fresh, fresh_opt)
        assert expected.keys() == got.keys()
        assert all(torch.equal(got[k], v) for k, v in expected.items())
        assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=f"already in {engine} format"):
        convert(newest, tmp_path / "same", to="dcp", engine=engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_save_consolidated_and_export_hf_load_with_equal_logits(engine: str, tmp_path: Path) -> None:
    model, _, (first, newest) = run(tmp_path / "run", engine, save_consolidated="final")
    assert not (first / "hf").exists()  # "final": the last save only
    expected = logits(model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(newest / "hf")
    assert torch.equal(logits(loaded), expected)
    assert read_checkpoint_json(newest)["files"]["hf/model.safetensors"]["size"] > 0  # committed with it
    result = export_hf(newest, tmp_path / "sharded", max_shard_size="64KB", buffer_size="16KB")
    assert len(result.files) > 1
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")), expected)
    bundle = pack_bundle(newest, tmp_path / "run.tar")
    export_hf(bundle, tmp_path / "from-bundle", dtype="bfloat16")
    cast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "from-bundle")
    assert cast.dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "theirs")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "theirs", dtype=torch.bfloat16)
    assert torch.equal(logits(cast), logits(reference))


@pytest.mark.parametrize("engine", ENGINES)
def test_peft_adapter_and_merged_lora_from_every_engine(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tiny_llama()
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=5e-2)
    for _ in range(2):
        train(lora, opt)
    cfg = CheckpointConfig(save_dir=str(tmp_path / "run"), engine=engine, fsync=False)
    with DefaultCheckpointManager(cfg) as manager:
        result = manager.save(SaveContext(model=lora, train_state=TrainState(step=1), force=True))
    assert result is not None
    expected = logits(lora)

    export_peft(result.path, tmp_path / "adapter")
    restored = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    assert torch.equal(logits(restored), expected)
    code, _ = cli(capsys, "export", result.path, "--to", "peft", "--out", str(tmp_path / "adapter2"))
    assert code == 0
    assert load_file(str(tmp_path / "adapter2" / "adapter_model.safetensors")).keys() == load_file(
        str(tmp_path / "adapter" / "adapter_model.safetensors")
    ).keys()
    code, doc = cli(capsys, "export", result.path, "--to", "hf", "--merge-lora", "--out", str(tmp_path / "merged"))
    assert code == 0 and doc["merged_adapter"] == "default"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=1e-5)  # merged arithmetic differs


@pytest.mark.parametrize("engine", ENGINES)
def test_a_bundle_is_inspected_from_the_engines_index_files_only(engine: str, tmp_path: Path) -> None:
    _, _, (_, newest) = run(tmp_path / "run", engine)
    bundle = pack_bundle(newest, tmp_path / "run.tar")
    info = read_bundle_metadata(bundle, tmp_path / "meta")
    extracted = sorted(p.relative_to(info.checkpoint).as_posix() for p in info.checkpoint.rglob("*") if p.is_file())
    # DCP names its index (.metadata); the others do not, so every file of theirs comes along
    every = ["checkpoint.json", *read_checkpoint_json(newest)["files"]]
    assert extracted == sorted(["checkpoint.json", "state.json", ".metadata"] if engine == "dcp" else every)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_checkpoint_at_a_url_is_read_through_its_engine(engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"memory://reading-{uuid.uuid4().hex[:8]}/run"
    model = tiny_llama()
    with DefaultCheckpointManager(CheckpointConfig(save_dir=url, engine=engine)) as manager:
        result = manager.save(SaveContext(model=model, train_state=TrainState(step=3), force=True))
    assert result is not None and result.path.startswith("memory://")
    code, doc = cli(capsys, "inspect", url)
    assert code == 0 and doc["meta"]["engine"] == engine
    assert {t["name"] for t in doc["tensors"]} == {f"model.{k}" for k in model.state_dict()}
    code, doc = cli(capsys, "diff", url, result.path)
    assert code == 0 and doc["equal"] and doc["compared"] == len(model.state_dict())
    code, _ = cli(capsys, "export", url, "--to", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(model))


def test_export_reads_a_bounded_group_at_a_time_through_load(tmp_path: Path) -> None:
    """An engine with only ``read_index`` and ``load``: an export asks ``load`` for a buffer's worth of
    tensors at a time (a larger tensor alone), and never for one twice."""
    model, _, (_, newest) = run(tmp_path / "run", "safetensors")
    plain = open_directory(newest)

    class Counting:
        name = plain.engine.name

        def __init__(self) -> None:
            self.calls: list[dict[str, int]] = []

        def save(self, *args: Any) -> Any:
            raise AssertionError("a read never saves")

        def read_index(self, directory: Path, ctx: EngineContext) -> Any:
            return plain.engine.read_index(directory, ctx)

        def load(self, targets: dict[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
            self.calls.append({k: t.numel() * t.element_size() for k, t in targets.items()})
            plain.engine.load(targets, directory, ctx)

    counting = Counting()
    assert isinstance(counting, Engine)
    opened = open_directory(newest, engine=counting, meta=plain.meta)
    assert isinstance(opened.reader, IndexReader)
    buffer = 32 * 1024
    export_hf(opened, tmp_path / "hf", buffer_size=buffer, max_shard_size="10MB")
    read = [k for call in counting.calls for k in call]
    assert sorted(read) == sorted(f"model.{k}" for k in model.state_dict())  # each once, nothing else
    assert all(sum(c.values()) <= buffer or len(c) == 1 for c in counting.calls)
    assert len(counting.calls) > 3
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), logits(model))


def test_a_reader_is_rank_0_of_the_world_that_saved(tmp_path: Path) -> None:
    """An engine without ``reader`` is read as rank 0 of the world size that saved, alone."""
    seen: list[EngineContext] = []

    class Recording:
        name = "recording"

        def save(self, *args: Any) -> None:
            return None

        def read_index(self, directory: Path, ctx: EngineContext) -> dict[str, TensorInfo]:
            seen.append(ctx)
            return {"model.w": TensorInfo((2,), torch.float32)}

        def load(self, targets: dict[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
            seen.append(ctx)
            targets["model.w"].fill_(ctx.rank + 1)

    opened = open_directory(tmp_path, engine=Recording(), meta={"engine": "recording", "world_size": 3, "step": 9})
    assert torch.equal(opened.read(["model.w"])["model.w"], torch.ones(2))
    assert [(c.rank, c.world_size, c.process_group, c.step) for c in seen] == [(0, 3, None, 9)] * 2
    assert seen[0] is seen[1]  # read_index and load share one context, as in a load
