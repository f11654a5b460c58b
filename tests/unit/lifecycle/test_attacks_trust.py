"""Attacks on what a checkpoint may make this library do.

Each group is one promise, and its tests are named after it:

- ``test_code_choice_*``: a checkpoint never chooses the code that runs. A step directory that ships
  its own module and names it as its engine, on ``sys.path`` the way a namespace package of the
  working directory is, never gets it imported, by any load, ``initial_load_path``, any ``ckpt``
  command or a bundle; names read from other files (Hugging Face ``architectures``, dtype names) are
  looked up among known values only.
- ``test_bounded_json_*``: one JSON reader with depth and size limits reads every JSON this library
  reads (a grep finds no other parser of file contents); each kind of file nested past the limit is
  a typed error naming it (or, for hints such as pointers and lock files, ignored), never a
  ``RecursionError``.
- ``test_bundle_limits_*``: tar members are checked for depth, name length, count and size before
  anything is written; an unpack that fails leaves no partial tree; ``ckpt list`` and ``ckpt inspect``
  refuse what ``ckpt unpack`` refuses.
- ``test_cli_exit_*``: every ``ckpt`` command exits with the documented code for every typed error
  (4 for damaged or unsafe, never a traceback without ``--debug``, never 1 for an error: 1 means
  "tensors differ" or "verification failed"); ``ckpt verify`` fails what a load would refuse; a name
  template that cannot format a step is refused when the config is built.
- ``test_read_limits_*``: a save never commits what a load refuses: state nested past the JSON
  reader's depth is refused by the gather, naming the key path, before anything is written; the
  state files' readers accept every size a save writes, and a save refuses a file past them; ``pack``
  refuses a bundle its readers would refuse; a safetensors header readers refuse is never written.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DefaultCheckpointManager,
    EngineNotAvailableError,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.cli import main as ckpt
from checkpoint_manager.core.integrity import describe_files
from checkpoint_manager.core.layout import seal_checkpoint_json
from checkpoint_manager.engine.registry import engine_for_record
from tests.helpers.process import ROOT
from tests.unit.lifecycle.test_trust import build

STEP1, STEP2 = "step_00000001", "step_00000002"
PLANTED = f"ckpts.run.{STEP2}.evil"


def state_of(model: nn.Module, opt: torch.optim.Optimizer, ts: TrainState) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": [{k: v.clone() for k, v in s.items()} for s in opt.state.values()],
        "train_state": ts.state_dict(),
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["train_state"] == b["train_state"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert len(a["optim"]) == len(b["optim"])
    for x, y in zip(a["optim"], b["optim"], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def edit_meta(ckpt_dir: Path, **fields: Any) -> None:
    """Rewrite ``checkpoint.json`` with ``fields`` and every file re-recorded (as a crafted one would be)."""
    file = ckpt_dir / "checkpoint.json"
    meta = json.loads(file.read_text())
    meta.update(fields)
    meta["files"] = describe_files(ckpt_dir, {})
    file.write_text(json.dumps(seal_checkpoint_json(meta)))


def mgr(root: Path, **kw: Any) -> DefaultCheckpointManager:
    kw.setdefault("fsync", False)
    return DefaultCheckpointManager(CheckpointConfig(save_dir=str(root), **kw))


# -- a checkpoint never chooses the code that runs -----------------------------------------------------

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")
from checkpoint_manager.engine.dcp.engine import DCPEngine


class Engine(DCPEngine):
    name = {name!r}
"""


class Planted:
    """``tmp/ckpts/run`` with steps 1 and 2; step 2 ships ``evil.py`` (a working engine that leaves a
    marker when imported), records it among its files and names it as its engine. ``tmp`` is the
    working directory and on ``sys.path``, so ``ckpts.run.step_00000002.evil`` is importable."""

    def __init__(self, tmp: Path, engine: str) -> None:
        self.tmp = tmp
        self.root = tmp / "ckpts" / "run"
        self.marker = tmp / "IMPORTED"
        with mgr(self.root) as m:
            for step in (1, 2):
                model, opt, ts = build(step)
                if step == 1:
                    self.step1 = state_of(model, opt, ts)
                m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
        self.step2 = self.root / STEP2
        (self.step2 / "evil.py").write_text(EVIL.format(marker=str(self.marker), name=engine))
        edit_meta(self.step2, engine=engine)

    def assert_never_imported(self) -> None:
        assert not self.marker.exists(), "the module a checkpoint ships was imported"
        assert not [m for m in sys.modules if m == "ckpts" or m.startswith("ckpts.") or m == "this"]


HOSTILE_ENGINES = [f"{PLANTED}:Engine", f"{PLANTED}.Engine", "this:Engine", "this.Engine"]


@pytest.fixture(params=HOSTILE_ENGINES, ids=["planted_colon", "planted_dotted", "stdlib_colon", "stdlib_dotted"])
def planted(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Planted]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "this", raising=False)
    forget_planted()
    yield Planted(tmp_path, request.param)
    forget_planted()


def forget_planted() -> None:
    for name in [m for m in sys.modules if m == "ckpts" or m.startswith("ckpts.")]:
        del sys.modules[name]


def test_code_choice_the_planted_module_is_importable_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack is real: the planted module runs when something imports the recorded name."""
    import importlib

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    planted = Planted(tmp_path, f"{PLANTED}:Engine")
    try:
        module = importlib.import_module(PLANTED)
        assert planted.marker.read_text() == "imported" and module.Engine.name == f"{PLANTED}:Engine"
    finally:
        forget_planted()


@pytest.mark.parametrize("by", ["path", "step"])
def test_code_choice_a_pinned_load_refuses_the_recorded_engine(planted: Planted, by: str) -> None:
    model, opt, ts = build(9)
    before = state_of(model, opt, ts)
    where: dict[str, Any] = {"path": str(planted.step2)} if by == "path" else {"step": 2}
    with mgr(planted.root) as m, pytest.raises(EngineNotAvailableError) as info:
        m.load(LoadContext(model=model, optimizer=opt, train_state=ts, **where))
    recorded = json.loads((planted.step2 / "checkpoint.json").read_text())["engine"]
    assert str(info.value) == (
        f"{planted.step2}: checkpoint.json records engine {recorded!r}, which this process does not have: "
        "it is neither a built-in engine ('dcp') nor an engine installed in entry-point group "
        "'checkpoint_manager.engines' (installed: safetensors, torch_checkpointing); the config names "
        "engine='dcp'. A name read from a checkpoint is never imported: install the package that provides "
        f"engine {recorded!r}, or pass engine= naming it yourself"
    )
    assert isinstance(info.value, CheckpointCorruptError)
    assert_same(before, state_of(model, opt, ts))
    planted.assert_never_imported()


def test_code_choice_initial_load_path_refuses_the_recorded_engine(planted: Planted) -> None:
    model, opt, ts = build(9)
    before = state_of(model, opt, ts)
    with mgr(planted.tmp / "fresh", initial_load_path=str(planted.step2)) as m:
        assert m.should_load(LoadContext(model=model))
        with pytest.raises(EngineNotAvailableError, match=r"records engine .* which this process does not have"):
            m.load(LoadContext(model=model, optimizer=opt, train_state=ts))
    assert_same(before, state_of(model, opt, ts))
    planted.assert_never_imported()


def test_code_choice_the_registry_never_imports_a_recorded_name(planted: Planted) -> None:
    recorded = json.loads((planted.step2 / "checkpoint.json").read_text())["engine"]
    for config in (None, CheckpointConfig(save_dir=str(planted.root)), {"engine": "dcp"}):
        with pytest.raises(EngineNotAvailableError, match="A name read from a checkpoint is never imported"):
            engine_for_record(recorded, config)
    planted.assert_never_imported()


def test_code_choice_a_bundle_of_the_checkpoint_refuses_its_engine(planted: Planted) -> None:
    bundle = planted.tmp / "hostile.tar"
    assert ckpt(["pack", str(planted.step2), str(bundle)]) == 0
    model, opt, ts = build(9)
    before = state_of(model, opt, ts)
    with mgr(planted.tmp / "elsewhere") as m, pytest.raises(EngineNotAvailableError):
        m.load(LoadContext(model=model, optimizer=opt, train_state=ts, path=str(bundle)))
    with mgr(planted.tmp / "fresh", initial_load_path=str(bundle)) as m, pytest.raises(EngineNotAvailableError):
        m.load(LoadContext(model=model, optimizer=opt, train_state=ts))
    assert_same(before, state_of(model, opt, ts))
    for args in (["list", str(bundle)], ["inspect", str(bundle)], ["unpack", str(bundle), str(planted.tmp / "out")]):
        assert ckpt([*args, "--json"]) in (0, 4), args
    planted.assert_never_imported()


#: every command on the planted checkpoint, and its exit code: listing, packing and pruning read no
#: tensor (0), verification fails it (1), every reader refuses its engine (4)
CLI_COMMANDS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("list", "{root}")),
    (1, ("list", "{root}", "--verify", "full")),
    (4, ("inspect", "{step2}")),
    (1, ("verify", "{root}")),
    (1, ("verify", "{step2}", "--sizes")),
    (4, ("diff", "{step1}", "{step2}")),
    (4, ("export", "{step2}", "--to", "safetensors", "--out", "{tmp}/export.safetensors")),
    (4, ("convert", "{step2}", "{tmp}/converted.safetensors", "--to", "safetensors")),
    (0, ("pack", "{step2}", "{tmp}/packed.tar")),
    (0, ("prune", "{root}", "--keep-last", "1", "--dry-run")),
    (0, ("cache", "list")),
]


def test_code_choice_no_ckpt_command_imports_the_recorded_engine(
    planted: Planted, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {"root": planted.root, "step1": planted.root / STEP1, "step2": planted.step2, "tmp": planted.tmp}
    recorded = json.loads((planted.step2 / "checkpoint.json").read_text())["engine"]
    for expected, command in CLI_COMMANDS:
        argv = [part.format(**names) for part in command]
        code = ckpt([*argv, "--json"])
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err, argv
        assert code == expected, (argv, code, captured.err)
        if code:
            assert f"records engine {recorded!r}" in captured.err + captured.out, argv
        planted.assert_never_imported()


def test_code_choice_auto_resume_falls_back_past_the_recorded_engine(
    planted: Planted, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint whose engine this process lacks cannot be loaded: auto-resume skips it with a
    warning naming it and the cause, and loads the one before, bit-exact."""
    model, opt, ts = build(9)
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"), mgr(planted.root) as m:
        assert m.should_load(LoadContext(model=model))
        result = m.load(LoadContext(model=model, optimizer=opt, train_state=ts))
    assert result.step == 1
    assert_same(planted.step1, state_of(model, opt, ts))
    assert STEP2 in caplog.text and "which this process does not have" in caplog.text
    planted.assert_never_imported()


# -- the engines a recorded name may choose ------------------------------------------------------------


def test_code_choice_a_name_the_config_chose_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own ``engine=`` may be a dotted path: a checkpoint recording that path (or the
    class's ``name``) loads with it, and only with it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "IMPORTED"
    (tmp_path / "user_engines.py").write_text(EVIL.format(marker=str(marker), name="user-raw"))
    monkeypatch.delitem(sys.modules, "user_engines", raising=False)
    model, opt, ts = build(3)
    saved = state_of(model, opt, ts)
    with mgr(tmp_path / "run", engine="user_engines:Engine") as m:
        m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
    ckpt_dir = tmp_path / "run" / "step_00000003"
    assert json.loads((ckpt_dir / "checkpoint.json").read_text())["engine"] == "user-raw"
    del sys.modules["user_engines"]
    marker.unlink()
    with mgr(tmp_path / "run") as m, pytest.raises(EngineNotAvailableError, match="records engine 'user-raw'"):
        m.load(LoadContext(model=model))
    assert not marker.exists() and "user_engines" not in sys.modules
    for spelling in ("user_engines:Engine", "user_engines.Engine"):  # the config names it: resolved by name
        fresh, fresh_opt, fresh_ts = build(8)
        engine = engine_for_record("user-raw", CheckpointConfig(save_dir=str(tmp_path), engine=spelling))
        assert type(engine).__name__ == "Engine" and type(engine).name == "user-raw"
        with mgr(tmp_path / "other", load_dir=str(tmp_path / "run"), engine=spelling) as m:
            m.load(LoadContext(model=fresh, optimizer=fresh_opt, train_state=fresh_ts))
        assert_same(saved, state_of(fresh, fresh_opt, fresh_ts))


def test_code_choice_installed_engines_by_entry_point_and_by_recorded_name(tmp_path: Path) -> None:
    from cm_safetensors import SafetensorsEngine

    assert type(engine_for_record("safetensors")) is SafetensorsEngine
    assert type(engine_for_record("dcp")).__name__ == "DCPEngine"
    site = tmp_path / "site"
    info = site / "renamed_engines-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: renamed-engines\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[checkpoint_manager.engines]\nst-under-another-name = cm_safetensors:SafetensorsEngine\n"
    )
    sys.path.insert(0, str(site))
    try:
        assert type(engine_for_record("st-under-another-name")) is SafetensorsEngine
    finally:
        sys.path.remove(str(site))


@pytest.mark.parametrize("name", ["", " dcp", 7, None])
def test_code_choice_a_recorded_engine_that_is_no_name_is_damage(name: Any) -> None:
    with pytest.raises(CheckpointCorruptError, match=r"^checkpoint.json records no engine name"):
        engine_for_record(name)


def test_code_choice_the_planted_checkpoint_loads_once_the_user_names_its_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a ban on the module, a rule on who names it: the user may choose to run it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    planted = Planted(tmp_path, f"{PLANTED}:Engine")
    model, opt, ts = build(9)
    try:
        with mgr(tmp_path / "other", load_dir=str(planted.root), engine=f"{PLANTED}:Engine") as m:
            assert m.load(LoadContext(model=model, optimizer=opt, train_state=ts, path=str(planted.step2))).step == 2
        assert planted.marker.exists()
    finally:
        forget_planted()
    shutil.rmtree(planted.root)


# -- other names read from files: looked up among known values, never imported --------------------------

LOOKUP_CHILD = """
import json, sys
from pathlib import Path
import torch
{body}
print(json.dumps(sorted(m for m in sys.modules if m in {watched!r})))
"""


def _imported_by(body: str, watched: list[str]) -> list[str]:
    import subprocess

    code = LOOKUP_CHILD.format(body=body, watched=watched)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_code_choice_hf_architectures_are_looked_up_among_registered_model_classes() -> None:
    """``config.json``'s ``architectures`` names a class of transformers' lazy module: a name that is
    not a registered model class (``pipeline`` would import ``transformers.pipelines``) is passed over."""
    body = (
        "from checkpoint_manager.formats.hf import tied_pairs\n"
        "pairs = tied_pairs({'tie_word_embeddings': True, 'architectures': ['pipeline', 'Trainer', 'LlamaForCausalLM']})\n"
        "assert pairs == {'lm_head.weight': 'model.embed_tokens.weight'}, pairs\n"
    )
    assert _imported_by(body, ["transformers.pipelines", "transformers.trainer"]) == []


def test_code_choice_dtype_names_in_engine_files_are_looked_up_among_torch_dtypes(tmp_path: Path) -> None:
    """``getattr(torch, name)`` imports ``torch._dynamo`` for ``_dynamo``: a dtype name from a file is
    looked up among torch's dtypes only, and an unknown one is damage."""
    file = tmp_path / "dtypes_0.json"
    file.write_text(json.dumps({"k": ["_dynamo", [2]]}))
    body = (
        "from checkpoint_manager import CheckpointCorruptError, TensorInfo\n"
        "from cm_torch_checkpointing.engine import _raw_index\n"
        f"file = Path({str(file)!r})\n"
        "try:\n"
        "    _raw_index(file, {'k': TensorInfo((8,), torch.uint8)})\n"
        "except CheckpointCorruptError as exc:\n"
        "    assert \"'k' names no torch dtype ('_dynamo')\" in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('accepted')\n"
    )
    assert _imported_by(body, ["torch._dynamo"]) == []


# -- one bounded JSON reader ---------------------------------------------------------------------------

REPO = ROOT
PACKAGE_SOURCES = [REPO / "checkpoint_manager", *sorted((REPO / "plugins").glob("*/src"))]


def test_bounded_json_no_other_parser_reads_json() -> None:
    """Every ``json.load``/``json.loads`` of the package and its plugins is the bounded reader's own."""
    import re

    found = []
    for root in PACKAGE_SOURCES:
        for file in sorted(root.rglob("*.py")):
            if file.name == "safe_io.py" and file.parent.name == "core":
                continue
            for number, line in enumerate(file.read_text().splitlines(), 1):
                if re.search(r"\bjson\.loads?\(|\bfrom json import\b.*\bloads?\b|\bJSONDecoder\(", line):
                    found.append(f"{file.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], "JSON parsed outside checkpoint_manager.core.safe_io.parse_json:\n" + "\n".join(found)


def deep(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (deep(256), True),
        (deep(257), False),
        ('{"a": ' * 257 + "1" + "}" * 257, False),
        ('["' + "[" * 5000 + '"]', True),  # brackets inside a string are text
        ('["\\"' + "[" * 5000 + '"]', True),  # an escaped quote does not end the string
        ('["\\\\", ' + deep(256) + "]", False),  # an escaped backslash does
        ('["][", ' * 200 + "1" + "]" * 200, True),  # strings cannot hide depth ...
        ('["][", ' * 257 + "1" + "]" * 257, False),  # ... either way
        ("[" * 5000, False),  # unclosed
        ("]" * 5000 + "[", None),  # malformed, shallow: the parser's own message
    ],
)
def test_bounded_json_the_reader_measures_depth_without_parsing(text: str, ok: bool | None) -> None:
    from checkpoint_manager import parse_json

    if ok:
        assert parse_json(text.encode(), "x.json") == json.loads(text)
        return
    with pytest.raises(CheckpointCorruptError) as info:
        parse_json(text.encode(), "dir/x.json")
    expected = "nested deeper than 256 levels" if ok is False else "Expecting value"
    assert str(info.value).startswith("dir/x.json: not valid JSON (") and expected in str(info.value)


def test_bounded_json_the_reader_bounds_size_and_takes_the_callers_error(tmp_path: Path) -> None:
    from checkpoint_manager import parse_json, read_json

    with pytest.raises(CheckpointCorruptError, match=r"^f\.json: 11 bytes of JSON, more than the 10 such a file may hold$"):
        parse_json(b'"123456789"', "f.json", limit=10)
    with pytest.raises(ValueError, match=r"^cfg\.json: not valid JSON \(nested deeper than 3 levels\)$") as info:
        parse_json(deep(4), "cfg.json", depth=3, error=ValueError)
    assert not isinstance(info.value, CheckpointCorruptError)
    file = tmp_path / "x.json"
    file.write_text(deep(300))
    with pytest.raises(CheckpointCorruptError, match=rf"^{file}: not valid JSON \(nested deeper than 256 levels\)$"):
        read_json(file)
    os_fifo = tmp_path / "fifo.json"
    import os

    os.mkfifo(os_fifo)
    with pytest.raises(CheckpointCorruptError, match="is not a regular file"):
        read_json(os_fifo)


DEEP_JSON = deep(5_000)  # past any recursion limit: a RecursionError wherever a plain parser reads it


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    with mgr(tmp_path / "run", event_log=True) as m:
        for step in (1, 2):
            model, opt, ts = build(step)
            m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
    return tmp_path / "run"


def test_bounded_json_a_deep_pointer_is_no_pointer(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (saved / "latest").write_text(DEEP_JSON)
    model, opt, ts = build(9)
    with mgr(saved) as m:
        assert m.load(LoadContext(model=model, optimizer=opt, train_state=ts)).step == 2
    assert ckpt(["list", str(saved), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in listed["checkpoints"]] == [1, 2]


def test_bounded_json_a_deep_event_log_line_is_skipped(saved: Path) -> None:
    from checkpoint_manager import read_event_log

    log = saved / "checkpoint_events.jsonl"
    good = log.read_text().splitlines()
    log.write_text("\n".join([good[0], DEEP_JSON, *good[1:]]) + "\n")
    assert read_event_log(log) == [json.loads(line) for line in good]


def test_bounded_json_a_deep_lock_file_names_no_owner(tmp_path: Path) -> None:
    from checkpoint_manager.storage.lock import LOCK_FILE, read_lock_owner

    (tmp_path / LOCK_FILE).write_text(DEEP_JSON)
    assert read_lock_owner(tmp_path) is None


def test_bounded_json_a_deep_hf_config_is_damage(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from checkpoint_manager import export_hf

    step = saved / STEP2
    (step / "hf_config.json").write_text(DEEP_JSON)
    edit_meta(step)
    with pytest.raises(CheckpointCorruptError, match=rf"^{step / 'hf_config.json'}: not valid JSON \(nested deeper"):
        export_hf(step, tmp_path / "hf")
    assert ckpt(["export", str(step), "--to", "hf", "--out", str(tmp_path / "hf2")]) == 4
    assert "nested deeper than 256 levels" in capsys.readouterr().err


@pytest.mark.parametrize("file", ["state.json", "rank_00000.json", "checkpoint.json"])
def test_bounded_json_deep_checkpoint_files_are_damage(saved: Path, file: str) -> None:
    step = saved / STEP2
    (step / file).write_text(deep(300))  # past the reader's limit, short of the interpreter's
    if file != "checkpoint.json":
        edit_meta(step)
    model, opt, ts = build(9)
    before = state_of(model, opt, ts)
    with mgr(saved) as m, pytest.raises(CheckpointCorruptError, match=rf"{file}: .*nested deeper than 256 levels"):
        m.load(LoadContext(model=model, optimizer=opt, train_state=ts, path=str(step)))
    assert_same(before, state_of(model, opt, ts))


def test_bounded_json_deep_files_next_to_weights_are_typed_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import struct

    from checkpoint_manager.formats.hf import hf_weight_files
    from checkpoint_manager.formats.safetensors_io import SafetensorsFile

    header = DEEP_JSON.encode()
    weights = tmp_path / "deep.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointCorruptError, match=r"deep\.safetensors: header: not valid JSON \(nested deeper"):
        SafetensorsFile(weights)
    assert ckpt(["convert", str(weights), str(tmp_path / "out.pt"), "--to", "torch"]) == 4
    assert "nested deeper than 256 levels" in capsys.readouterr().err
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(DEEP_JSON)
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors\.index\.json: not valid JSON \(nested deeper"):
        hf_weight_files(hf)


def test_bounded_json_a_deep_config_file_is_a_value_error(tmp_path: Path) -> None:
    file = tmp_path / "config.json"
    file.write_text(DEEP_JSON)
    with pytest.raises(ValueError, match=rf"^{file}: not valid JSON \(nested deeper than 256 levels\)$"):
        CheckpointConfig.from_file(file)


@pytest.mark.parametrize("member", ["bundle.json", "checkpoint_config.json"])
def test_bounded_json_deep_bundle_metadata_is_damage(saved: Path, tmp_path: Path, member: str) -> None:
    import tarfile

    bundle = tmp_path / "b.tar"
    assert ckpt(["pack", str(saved / STEP2), str(bundle)]) == 0
    rebuilt = tmp_path / "deep.tar"
    with tarfile.open(bundle) as src, tarfile.open(rebuilt, "w") as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read() if info.isfile() else None  # type: ignore[union-attr]
            if info.name == member or (member == "checkpoint_config.json" and info.name == "bundle.json"):
                manifest = json.loads(data or b"{}")
                if member == "checkpoint_config.json":
                    manifest["config"] = member
                data = (json.dumps(manifest) if info.name != member else DEEP_JSON).encode()
                info.size = len(data)
            dst.addfile(info, None if data is None else __import__("io").BytesIO(data))
        if member == "checkpoint_config.json":
            info = tarfile.TarInfo(member)
            info.size = len(DEEP_JSON)
            dst.addfile(info, __import__("io").BytesIO(DEEP_JSON.encode()))
    model, opt, ts = build(9)
    with mgr(tmp_path / "x") as m, pytest.raises(CheckpointCorruptError, match=rf"{member}: .*nested deeper than 256"):
        m.load(LoadContext(model=model, optimizer=opt, train_state=ts, path=str(rebuilt)))


# -- tar bundles: every member checked before anything is written --------------------------------------


def _tar(path: Path, members: list[tuple[str, bytes | None]]) -> Path:
    """A tar of ``(name, data)`` members (``None``: a directory)."""
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize(
    ("members", "problem"),
    [
        ([("a/" * n, None) for n in range(1, 2001)], "is nested more than 32 directories deep"),
        ([("d/" * 33 + "f", b"x")], "is nested more than 32 directories deep"),
        ([("n" * 1100, b"x")], "is a name of 1100 characters (at most 1024)"),
    ],
    ids=["2000_nested_directories", "33_deep", "long_name"],
)
def test_bundle_limits_deep_members_are_refused_by_every_reader(
    tmp_path: Path, members: list[tuple[str, bytes | None]], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkpoint_manager import UnsafeCheckpointError

    bundle = _tar(tmp_path / "deep.tar", [("bundle.json", b"{}"), *members])
    dest = tmp_path / "out"
    for argv in (["unpack", str(bundle), str(dest)], ["list", str(bundle)], ["inspect", str(bundle)]):
        assert ckpt([*argv, "--json"]) == 4, argv
        err = capsys.readouterr().err
        assert f"{bundle}: member " in err and problem in err and "Traceback" not in err, err
    assert not dest.exists()
    model = nn.Linear(2, 2)
    with mgr(tmp_path / "x") as m, pytest.raises(UnsafeCheckpointError, match=re.escape(problem)):
        m.load(LoadContext(model=model, path=str(bundle)))


def test_bundle_limits_a_member_count_limit(tmp_path: Path) -> None:
    from checkpoint_manager import BundleTooLargeError
    from checkpoint_manager.formats.bundle import BundleLimits, extract_bundle, list_bundle

    assert BundleLimits().max_members == 100_000 and BundleLimits().max_depth == 32
    bundle = _tar(tmp_path / "many.tar", [(f"e{i}", b"") for i in range(101)])
    limits = BundleLimits(max_members=100)
    for read in (lambda: list_bundle(bundle, limits=limits), lambda: extract_bundle(bundle, tmp_path / "o", limits=limits)):
        with pytest.raises(BundleTooLargeError, match=r"many\.tar: has more than 100 members; refusing to read further"):
            read()
    assert not (tmp_path / "o").exists()
    assert len(list_bundle(bundle, limits=BundleLimits(max_members=101))) == 101


def test_bundle_limits_a_failed_unpack_leaves_no_partial_tree(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bundle whose last member's data is cut off passes the header checks and fails mid-extraction."""
    bundle = tmp_path / "b.tar"
    assert ckpt(["pack", str(saved / STEP2), str(bundle)]) == 0
    data = bundle.read_bytes()
    import tarfile

    with tarfile.open(bundle) as tar:
        last = tar.getmembers()[-1]
    assert last.size > 100
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: last.offset_data + last.size // 2])
    dest = tmp_path / "out"
    assert ckpt(["unpack", str(cut), str(dest)]) == 4
    assert "truncated or damaged tar" in capsys.readouterr().err
    assert not dest.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ckpt(["unpack", str(cut), str(empty)]) == 4
    assert list(empty.iterdir()) == []


# -- ckpt: documented exit codes, and verify fails what a load refuses ----------------------------------


def _symlinked_data_file(step: Path, tmp: Path) -> None:
    data = step / "__0_0.distcp"
    outside = tmp / "outside.distcp"
    shutil.copy(data, outside)
    data.unlink()
    data.symlink_to(outside)


def _refused_record(step: Path, tmp: Path) -> None:
    """The first tensor record claims a storage one byte longer than its tensor (its zip directory
    says so, and its envelope is not the writer's), every recorded size and CRC-32 rewritten to match."""
    data = step / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    assert raw[:4] == b"PK\x03\x04"
    raw[:4] = b"PK\x07\x07"  # not our writer's envelope: the reader goes by the zip's directory
    pos = raw.find(b"PK\x01\x02")
    while not raw[pos + 46 : pos + 46 + int.from_bytes(raw[pos + 28 : pos + 30], "little")].endswith(b"/data/0"):
        pos = raw.find(b"PK\x01\x02", pos + 4)
    for field in (pos + 20, pos + 24):  # compressed and uncompressed size of the storage
        raw[field : field + 4] = (int.from_bytes(raw[field : field + 4], "little") + 1).to_bytes(4, "little")
    data.write_bytes(bytes(raw))
    edit_meta(step)


DAMAGES = {"symlinked_data_file": _symlinked_data_file, "refused_record": _refused_record}
READING_COMMANDS = [
    ("diff", "{step1}", "{step2}"),
    ("diff", "{step2}", "{step1}"),
    ("export", "{step2}", "--to", "safetensors", "--out", "{tmp}/e.safetensors"),
    ("export", "{step2}", "--to", "torch", "--out", "{tmp}/e.pt"),
    ("convert", "{step2}", "{tmp}/c.safetensors", "--to", "safetensors"),
    ("convert", "{step2}", "{tmp}/c.pt", "--to", "torch"),
]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_cli_exit_reading_a_refused_file_is_4_in_one_line(
    saved: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    step2 = saved / STEP2
    DAMAGES[damage](step2, tmp_path)
    names = {"step1": saved / STEP1, "step2": step2, "tmp": tmp_path}
    expected = {"symlinked_data_file": "is a symlink, where a regular file was expected",
                "refused_record": "step_00000002"}[damage]
    for command in READING_COMMANDS:
        argv = [part.format(**names) for part in command]
        code = ckpt(argv)
        err = capsys.readouterr().err
        assert code == 4, (argv, code, err)  # never 1 ("tensors differ"), never a traceback
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"ckpt {argv[0]}: error: ") and expected in err, err
        assert ckpt([*argv, "--debug"]) == 4
        assert "Traceback" in capsys.readouterr().err  # --debug shows it


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_cli_exit_verify_fails_a_file_a_load_refuses(saved: Path, tmp_path: Path, damage: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    step2 = saved / STEP2
    DAMAGES[damage](step2, tmp_path)
    model, opt, ts = build(9)
    with mgr(saved, verify_on_load="full") as m, pytest.raises(CheckpointCorruptError):
        m.load(LoadContext(model=model, optimizer=opt, train_state=ts, path=str(step2)))
    assert ckpt(["verify", str(step2), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["checkpoints"][0]["problems"]
    assert ckpt(["verify", str(saved)]) == 1
    assert f"FAILED {STEP2}" in capsys.readouterr().out


def test_cli_exit_verify_fails_state_a_load_cannot_decode(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step2 = saved / STEP2
    state = json.loads((step2 / "state.json").read_text())
    state["planted"] = {"__cm__": "no_such_tag"}
    (step2 / "state.json").write_text(json.dumps(state))
    edit_meta(step2)
    model, opt, ts = build(9)
    with mgr(saved) as m, pytest.raises(CheckpointCorruptError, match=r"state\.json: damaged state"):
        m.load(LoadContext(model=model, optimizer=opt, train_state=ts, path=str(step2)))
    for level in ("--sizes", "--full"):
        assert ckpt(["verify", str(step2), level]) == 1, level
        out = capsys.readouterr().out
        assert "state.json: damaged state" in out, out


def test_cli_exit_verify_fails_an_engine_this_process_lacks(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step2 = saved / STEP2
    edit_meta(step2, engine="no_such_pkg.engines:Engine")
    assert ckpt(["verify", str(saved)]) == 1
    out = capsys.readouterr().out
    assert "records engine 'no_such_pkg.engines:Engine', which this process does not have" in out


def test_cli_exit_verify_fails_a_symlinked_checkpoint_entry(saved: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A symlink in the save directory is no checkpoint to a load (discovery never follows one)."""
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(saved / STEP2), elsewhere)
    (saved / STEP2).symlink_to(elsewhere)
    model, opt, ts = build(9)
    with mgr(saved) as m:
        assert m.load(LoadContext(model=model, optimizer=opt, train_state=ts)).step == 1
        with pytest.raises(CheckpointNotFoundError):
            m.load(LoadContext(model=model, optimizer=opt, train_state=ts, step=2))
    assert ckpt(["verify", str(saved)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED {STEP2}" in out and f"{saved / STEP2}: a symlink (to '{elsewhere}'), not a checkpoint directory" in out


def test_cli_exit_verify_passes_intact_checkpoints_of_every_engine(saved: Path, tmp_path: Path) -> None:
    """The load's checks pass what a load passes: DCP and an installed plugin's engine, 1 rank."""
    assert ckpt(["verify", str(saved)]) == 0
    assert ckpt(["verify", str(saved), "--sizes"]) == 0
    with mgr(tmp_path / "st", engine="safetensors") as m:
        model, opt, ts = build(3)
        m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
    assert ckpt(["verify", str(tmp_path / "st")]) == 0


def _every_error() -> dict[str, BaseException]:
    """An instance of every error class the package exports (and those of its parts a command meets)."""
    import checkpoint_manager as cm
    from checkpoint_manager.core.safe_io import UnsafeFileError
    from checkpoint_manager.lifecycle.finite import NonFiniteStateError

    made: dict[str, BaseException] = {}
    for name in cm.__all__:
        cls = getattr(cm, name)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)) or issubclass(cls, Warning):
            continue
        if cls is cm.PostCommitError:
            made[name] = cls("ckpt", "the pointer", OSError("disk"))
        elif cls is NonFiniteStateError:
            made[name] = cls(1, ["model.w"], 1)
        elif cls is cm.NonFiniteCheckpointError:
            made[name] = cls("ckpt", ["model.w"], 1)
        else:
            made[name] = cls("x")
    made["UnsafeFileError"] = UnsafeFileError("x")
    return made


EXIT_CODES = {
    "CheckpointNotFoundError": 3,
    "CheckpointCorruptError": 4, "CheckpointVersionError": 4, "UnsafeCheckpointError": 4,
    "BundleTooLargeError": 4, "EngineNotAvailableError": 4, "UnsafeFileError": 4, "NonFiniteStateError": 4,
    "NonFiniteCheckpointError": 4,
    "CheckpointError": 4, "FrozenChangedError": 4,
    "CheckpointMismatchError": 2, "UnsupportedAdapterError": 2, "MissingConfigWarning": 2, "ExceedsReadLimitsError": 2,
    "CheckpointLockError": 5,
    "BundleCacheError": 6, "CollectiveTimeoutError": 6, "AsyncSaveError": 6, "PostCommitError": 6,
    "ManagerClosedError": 6,
}


def test_cli_exit_every_typed_error_has_its_documented_code() -> None:
    from checkpoint_manager.cli.errors import classify

    errors = _every_error()
    assert set(errors) <= set(EXIT_CODES), f"no documented exit code for {sorted(set(errors) - set(EXIT_CODES))}"
    for name, exc in errors.items():
        assert int(classify(exc)) == EXIT_CODES[name], name
        assert int(classify(exc)) != 1, name  # 1 is a finding (differences, a failed verification), not an error


def test_cli_exit_a_dcp_checkpoint_exception_is_its_ranks_error() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoint_manager.cli.errors import classify, describe
    from checkpoint_manager.core.safe_io import UnsafeFileError

    wrapped = CheckpointException("read", {0: (UnsafeFileError("d/x.distcp: is a symlink"), None)})
    assert not isinstance(wrapped, Exception)
    assert int(classify(wrapped)) == 4 and describe(wrapped) == "d/x.distcp: is a symlink"


@pytest.mark.parametrize(
    ("template", "shown"),
    [("{step:q}", "{step:q} cannot format an int: Unknown format code 'q'"),
     ("step_{step!z}", "{step!z} cannot format an int: Unknown conversion specifier z"),
     ("{step}_{loss:%Y}", "{loss:%Y} cannot format an int or a float")],
)
def test_cli_exit_a_name_template_that_cannot_format_is_refused_when_the_config_is_built(
    tmp_path: Path, template: str, shown: str
) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape(f"name_template {template!r}: {shown}")):
        CheckpointConfig(save_dir=str(tmp_path), name_template=template)
    for fine in ("step_{step:08d}", "{step}-{val_loss:.3f}", "{epoch:03d}_{step}", "{step:>6}", "{step!r}"):
        assert CheckpointConfig(save_dir=str(tmp_path), name_template=fine).name_template == fine


# -- a save never commits what a load refuses -----------------------------------------------------------


class Holder:
    """An extra (or a dataloader) whose whole state is one value."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def nested(kind: str, levels: int) -> Any:
    """``levels`` containers of one kind around a leaf (a tensor leaf for ``tensor``)."""
    value: Any = torch.arange(3.0) if kind == "tensor" else 7
    for _ in range(levels):
        value = {
            "dict": lambda v: {"a": v}, "tensor": lambda v: {"a": v}, "list": lambda v: [v, 1],
            "tuple": lambda v: (v,), "int_keys": lambda v: {1: v},
        }[kind](value)
    return value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _save_nested(root: Path, where: str, value: Any) -> None:
    model, opt, ts = build(1)
    parts: dict[str, Any] = {"extra": {"h": Holder(value)}} if where == "extra" else {"dataloader": Holder(value)}
    with mgr(root) as m:
        m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True, **parts))


@pytest.mark.parametrize("kind", ["dict", "tensor", "list", "tuple", "int_keys"])
@pytest.mark.parametrize("where", ["extra", "dataloader"])
def test_read_limits_state_nested_past_the_reader_is_refused_at_save(tmp_path: Path, where: str, kind: str) -> None:
    """The deepest state that saves loads back equal; one level more is refused by the gather, with the
    key path named and nothing written; far deeper is the same typed error, never a RecursionError."""
    from checkpoint_manager import ExceedsReadLimitsError

    def saves(levels: int) -> bool:
        try:
            _save_nested(tmp_path / f"run{levels}", where, nested(kind, levels))
        except ExceedsReadLimitsError:
            assert not (tmp_path / f"run{levels}" / STEP1).exists()
            assert list((tmp_path / f"run{levels}").glob(".pending/*")) == []  # gathered, refused, nothing written
            return False
        return True

    low, high = 1, 300  # the deepest that saves lies in [low, high)
    assert saves(low) and not saves(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if saves(mid) else (low, mid)
    assert low > 80  # a few levels of the file's own, and up to 3 per Python container (int-keyed dicts)
    model, opt, ts = build(5)
    holder = Holder()
    parts: dict[str, Any] = {"extra": {"h": holder}} if where == "extra" else {"dataloader": holder}
    with mgr(tmp_path / f"run{low}") as m:
        assert m.load(LoadContext(model=model, optimizer=opt, train_state=ts, **parts)).step == 1
    assert same(holder.value, nested(kind, low))
    for levels in (high, 5_000):
        with pytest.raises(ExceedsReadLimitsError) as info:
            _save_nested(tmp_path / "deeper", where, nested(kind, levels))
        shown = str(info.value)
        prefix = "extra.h.value" if where == "extra" else "dataloader.value"
        assert shown.startswith(f"cannot checkpoint the value at '{prefix}."), shown
        assert "more than the 256 every reader of a checkpoint accepts" in shown
    assert not (tmp_path / "deeper" / STEP1).exists()


def test_read_limits_state_json_past_the_small_file_bound_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 70 MB ``state.json`` (more than the 64 MiB of small files, less than the state files' bound)
    loads, and ``ckpt inspect``, ``ckpt verify`` and a bundle of it read it."""
    blob = bytes(range(256)) * (52 * 4096)  # 52 MiB: 70 MB of base64
    model, opt, ts = build(1)
    with mgr(tmp_path / "run") as m:
        m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True, extra={"h": Holder(blob)}))
    step = tmp_path / "run" / STEP1
    assert (step / "state.json").stat().st_size > 64 * 1024 * 1024
    model, opt, ts = build(5)
    holder = Holder()
    with mgr(tmp_path / "run") as m:
        assert m.load(LoadContext(model=model, optimizer=opt, train_state=ts, extra={"h": holder})).step == 1
    assert holder.value == blob
    bundle = tmp_path / "b.tar"
    assert ckpt(["pack", str(step), str(bundle)]) == 0
    capsys.readouterr()
    for shown in (step, bundle):
        assert ckpt(["inspect", str(shown), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        summary = report["summary"]
        assert "problems" not in summary and summary["optimizers"]["optim"]["param_groups"][0]["lr"] == 1e-2, shown
    assert ckpt(["verify", str(step)]) == 0


@pytest.mark.parametrize("part", ["dataloader", "extra"])
def test_read_limits_json_larger_than_its_readers_accept_is_refused_at_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """A rank JSON or ``state.json`` past the bound its readers apply (lowered here to 1 MiB, so that
    the state need not be 1 GiB) fails the save, naming the file and its largest part; the
    checkpoint before it stays the newest and loads."""
    from checkpoint_manager import ExceedsReadLimitsError
    from checkpoint_manager.core import layout

    root = tmp_path / "run"
    model, opt, ts = build(1)
    with mgr(root) as m:
        m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True))
    monkeypatch.setattr(layout, "STATE_JSON_LIMIT", 1 << 20)
    big = Holder("x" * (2 << 20))
    parts: dict[str, Any] = {"dataloader": big} if part == "dataloader" else {"extra": {"big": big}}
    model, opt, ts = build(2)
    file, largest = ("rank_00000.json", "'dataloader'") if part == "dataloader" else ("state.json", "'extra'")
    with mgr(root) as m, pytest.raises(ExceedsReadLimitsError, match=rf"{file}: \d+ bytes of JSON, more than the "
                                       rf"1048576 a load of it accepts; its largest parts: {largest} \d+ bytes"):
        m.save(SaveContext(model=model, optimizer=opt, train_state=ts, force=True, **parts))
    monkeypatch.undo()
    assert sorted(p.name for p in root.glob("step_*")) == [STEP1]
    assert list(root.glob(".pending/*")) == []
    model, opt, ts = build(5)
    with mgr(root) as m:
        assert m.load(LoadContext(model=model, optimizer=opt, train_state=ts)).step == 1


def test_read_limits_pack_refuses_a_bundle_its_readers_refuse(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Artifacts nested or named past the unpacking limits, a bundle past the byte limit, a compressed
    bundle past the ratio limit: refused by ``pack`` (exit 2, no bundle left), not by every reader later."""
    from checkpoint_manager import ExceedsReadLimitsError, pack_bundle
    from checkpoint_manager.formats.bundle import extract_bundle

    step = saved / STEP2
    deep_dir = tmp_path / "deep"
    (deep_dir / ("d/" * 33)).mkdir(parents=True)
    (deep_dir / ("d/" * 33) / "f").write_text("x")
    long_dir = tmp_path / "long"
    (long_dir / "/".join("n" * 230 for _ in range(5))).mkdir(parents=True)
    (long_dir / "/".join("n" * 230 for _ in range(5)) / "f").write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    for artifacts, problem in ((deep_dir, "nested more than 32 directories deep"), (long_dir, "characters (at most 1024)")):
        with pytest.raises(ExceedsReadLimitsError, match=re.escape(problem)):
            pack_bundle(step, out / "b.tar", artifacts_dir=artifacts)
        assert ckpt(["pack", str(step), str(out / "b.tar"), "--artifacts-dir", str(artifacts)]) == 2
        assert problem in capsys.readouterr().err
    monkeypatch.setenv("CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES", "4KB")
    with pytest.raises(ExceedsReadLimitsError, match="expands to more than 4000 bytes"):
        pack_bundle(step, out / "b.tar")
    monkeypatch.delenv("CHECKPOINT_MANAGER_BUNDLE_MAX_BYTES")
    zeros = tmp_path / "zeros"
    with mgr(zeros) as m:
        model = nn.Linear(4096, 4200, bias=False)
        nn.init.zeros_(model.weight)
        m.save(SaveContext(model=model, train_state=TrainState(step=1), force=True))
    with pytest.raises(ExceedsReadLimitsError, match=r"expands to more than 100 times .*; pack it without compression"):
        pack_bundle(zeros / STEP1, out / "z.tar.gz", compression="gz")
    assert sorted(p.name for p in out.iterdir()) == []  # nothing left, not even a temporary
    extract_bundle(pack_bundle(zeros / STEP1, out / "z.tar"), tmp_path / "unpacked")  # uncompressed: fine


def test_read_limits_a_safetensors_header_readers_refuse_is_never_written(tmp_path: Path) -> None:
    """Names that make the header larger than the 100 MiB every safetensors reader accepts."""
    from checkpoint_manager import ExceedsReadLimitsError
    from checkpoint_manager.formats.safetensors_io import SafetensorsWriter

    specs = {f"{i}." + "k" * (11 << 20): (torch.float32, (1,)) for i in range(10)}
    with pytest.raises(ExceedsReadLimitsError, match=r"w\.safetensors: the safetensors header of its 10 tensors is \d+ "
                                                     r"bytes, more than the 104857600 safetensors readers accept"):
        SafetensorsWriter(tmp_path / "w.safetensors", specs)
    assert list(tmp_path.iterdir()) == []
