"""Every deleter, every state a save directory can be in: what is deleted, and that what stays loads.

The deleters: a run's own retention (the default manager, and both tiers of the tiered manager),
``ckpt prune --yes``, :func:`checkpoint_manager.prune`, the tiered manager's replica store, and
``ckpt prune`` on object storage (the moto S3 server on loopback). They all go through one
:class:`~checkpoint_manager.Pruner`, so each case below states one expectation per kind of deleter:

* ``out``: a pass from outside a run (``ckpt prune``, ``prune()``, S3) over the directory as it is;
* ``run``: a run that auto-resumes and saves step 5, whose retention then runs;
* ``store``: the replica store pruning its own steps.

The states: the newest checkpoint truncated, bit-flipped, missing a file or missing its
``checkpoint.json`` (or with a flipped one); the ``latest`` pointer at a damaged, a deleted or a
foreign checkpoint; metrics missing, NaN or logged by only some checkpoints; a superseded line (and
its head damaged); a writer holding the lock. Each case asserts exactly what is left, that every
intact checkpoint left loads by path (step and weights), and what auto-resume loads.

The templates are saved once per module (a few tiny checkpoints) and copied for each case.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

from checkpoint_manager import (
    CheckpointConfig,
    CheckpointCorruptError,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)
from checkpoint_manager.cli import main
from checkpoint_manager.core.layout import CHECKPOINT_JSON, seal_checkpoint_json
from checkpoint_manager.lifecycle.retention import prune
from checkpoint_manager.storage import LocalStorage
from checkpoint_manager.storage.lock import LOCK_FILE
from tests.helpers.s3_server import MotoS3, storage_options

LOSS = {1: 0.4, 2: 0.1, 3: 0.2, 4: 0.3}  # the best by loss is 2, then 3
NEW_LINE_SEED = 103  # the weights of the new line's step 3 (template "rolled")
RUN_SEED = 5  # the weights of the step a run's deleter saves


def name(step: int) -> str:
    return f"step_{step:08d}"


ASIDE = name(3) + ".superseded"


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Linear(2, 2).state_dict()


def config(save_dir: Path | str, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(
        save_dir=str(save_dir), fsync=False, background_deletion=False, async_save=False, **kw
    )


def save(mgr: Any, step: int, seed: int, **metrics: float) -> None:
    model = nn.Linear(2, 2)
    model.load_state_dict(weights(seed))
    result = mgr.save(
        SaveContext(model=model, train_state=TrainState(step=step), metrics={"seed": seed, **metrics}, force=True)
    )
    assert result is not None


# -- the templates ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``plain``: steps 1-4, ``loss`` logged, nothing ranked. ``rolled``: the same, then a run went
    back to step 2 and saved step 3 again: the old 3 is set aside, 3 and 4 of the old line superseded."""
    base = tmp_path_factory.mktemp("deletion_templates")
    plain = base / "plain"
    with DefaultCheckpointManager(config(plain)) as mgr:
        for step, loss in LOSS.items():
            save(mgr, step, step, loss=loss)
    rolled = base / "rolled"
    shutil.copytree(plain, rolled)
    with DefaultCheckpointManager(config(rolled)) as mgr:
        mgr.load(LoadContext(model=nn.Linear(2, 2), train_state=TrainState(), step=2))
        save(mgr, 3, NEW_LINE_SEED, loss=0.25)
    assert sorted(p.name for p in rolled.iterdir() if p.name.startswith("step_")) == [
        name(1), name(2), name(3), ASIDE, name(4)
    ]
    return {"plain": plain, "rolled": rolled}


# -- the states ---------------------------------------------------------------------------------------
def data_file(ckpt: Path) -> Path:
    return ckpt / "__0_0.distcp"


def truncate(ckpt: Path) -> None:
    data_file(ckpt).write_bytes(data_file(ckpt).read_bytes()[:-8])


def flip_a_bit(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    file.write_bytes(bytes(raw))


def rewrite_metrics(ckpt: Path, change: Callable[[dict[str, Any]], None]) -> None:
    file = ckpt / CHECKPOINT_JSON
    meta = json.loads(file.read_text())
    change(meta["metrics"])
    file.write_text(json.dumps(seal_checkpoint_json(meta)))


def set_pointer(root: Path, data: dict[str, Any]) -> None:
    (root / "latest").write_text(json.dumps(data))


def hold_lock(root: Path) -> None:
    """The writer lock, as a live run on this host leaves it (the pytest process's parent is alive)."""
    owner = {"pid": os.getppid(), "host": socket.gethostname(), "started": "x", "started_unix": 0.0, "token": "t"}
    (root / LOCK_FILE).write_text(json.dumps(owner))


@dataclass(frozen=True)
class Expect:
    """What a deleter leaves: the checkpoints (by name), those found damaged, the step auto-resume
    takes next, and for ``ckpt prune`` the exit status (``None``: the deleter does not apply)."""

    left: tuple[str, ...]
    damaged: tuple[str, ...] = ()
    resumes: str | None = None
    code: int = 0


@dataclass(frozen=True)
class Case:
    template: str
    prepare: Callable[[Path], None]
    rules: dict[str, Any]
    out: Expect | None
    run: Expect | None
    store: Expect | None = None
    verify: str = "sizes"
    s3: bool = False
    broken: tuple[str, ...] = ()  # what the state damaged: if left, it must fail to load
    foreign: tuple[str, ...] = ()  # entries that are no (listed) checkpoint and must stay untouched
    tiers: tuple[str, ...] = ("local", "durable")


def _nothing(root: Path) -> None:
    return None


N = [name(s) for s in range(6)]  # N[1] .. N[5]
KEEP_1 = {"keep_last": 1}
BEST_1 = {"keep_last": 1, "keep_best": 1, "monitor": "loss", "mode": "min"}

CASES: dict[str, Case] = {
    "intact": Case(
        "plain", _nothing, KEEP_1,
        out=Expect((N[4],), resumes=N[4]),
        run=Expect((N[4], N[5]), resumes=N[5]),  # 4: the checkpoint the run resumed from
        store=Expect((N[4],)), s3=True,
    ),
    "newest_truncated": Case(
        "plain", lambda r: truncate(r / N[4]), KEEP_1,
        out=Expect((N[3], N[4]), damaged=(N[4],), resumes=N[3], code=4),
        # the run resumes from 3, so its save supersedes the damaged 4: kept as superseded
        run=Expect((N[3], N[4], N[5]), resumes=N[5]),
        store=Expect((N[3], N[4])), s3=True,
        broken=(N[4],),
    ),
    "newest_bit_flipped": Case(
        "plain", lambda r: flip_a_bit(data_file(r / N[4])), KEEP_1,
        out=Expect((N[3], N[4]), damaged=(N[4],), resumes=N[3], code=4),
        run=Expect((N[3], N[4], N[5]), resumes=N[5]),
        store=Expect((N[3], N[4])), verify="full",
        broken=(N[4],),
    ),
    "newest_missing_a_file": Case(
        "plain", lambda r: data_file(r / N[4]).unlink(), KEEP_1,
        out=Expect((N[3], N[4]), damaged=(N[4],), resumes=N[3], code=4),
        run=Expect((N[3], N[4], N[5]), resumes=N[5]),
        store=Expect((N[3], N[4])), s3=True,
        broken=(N[4],),
    ),
    "newest_without_checkpoint_json": Case(
        "plain", lambda r: (r / N[4] / CHECKPOINT_JSON).unlink(), KEEP_1,
        out=Expect((N[3],), resumes=N[3]),
        run=Expect((N[3], N[5]), resumes=N[5]),
        store=Expect((N[3],)), s3=True, foreign=(N[4],),
    ),
    "newest_checkpoint_json_flipped": Case(
        "plain", lambda r: flip_a_bit(r / N[4] / CHECKPOINT_JSON), KEEP_1,
        out=Expect((N[3],), resumes=N[3]),
        run=Expect((N[3], N[5]), resumes=N[5]),
        foreign=(N[4],),
    ),
    "pointer_at_a_damaged_checkpoint": Case(
        "plain", lambda r: [set_pointer(r, {"name": N[2], "step": 2}), truncate(r / N[2])], KEEP_1,
        out=Expect((N[2], N[4]), damaged=(N[2],), resumes=N[4], code=4),
        run=Expect((N[4], N[5]), resumes=N[5]),  # the run's commit moved latest to 5
        broken=(N[2],),
    ),
    "pointer_at_a_deleted_checkpoint": Case(
        "plain", lambda r: set_pointer(r, {"name": name(9), "step": 9}), KEEP_1,
        out=Expect((N[4],), resumes=N[4]),
        run=Expect((N[4], N[5]), resumes=N[5]),
    ),
    "pointer_at_a_foreign_checkpoint": Case(
        # another run's pointer: its line passes through none of these checkpoints, so it rules nothing
        "plain", lambda r: set_pointer(r, {"name": name(9), "step": 9, "lineage": {"seq": 9, "line": [[7, 9]]}}),
        KEEP_1,
        out=Expect((N[4],), resumes=N[4]),
        run=Expect((N[4], N[5]), resumes=N[5]),
    ),
    "metrics_intact": Case(
        "plain", _nothing, BEST_1,
        out=Expect((N[2], N[4]), resumes=N[4]),
        run=Expect((N[2], N[4], N[5]), resumes=N[5]), tiers=("durable",),
    ),
    "metrics_best_damaged": Case(
        "plain", lambda r: truncate(r / N[2]), BEST_1,
        out=Expect((N[2], N[3], N[4]), damaged=(N[2],), resumes=N[4], code=4),
        run=Expect((N[2], N[3], N[4], N[5]), resumes=N[5]), tiers=("durable",),
        broken=(N[2],),
    ),
    "metrics_missing": Case(
        "plain", lambda r: rewrite_metrics(r / N[2], lambda m: m.pop("loss")), BEST_1,
        out=Expect((N[3], N[4]), resumes=N[4]),
        run=Expect((N[3], N[4], N[5]), resumes=N[5]), tiers=("durable",),
    ),
    "metrics_nan": Case(
        "plain", lambda r: rewrite_metrics(r / N[2], lambda m: m.__setitem__("loss", float("nan"))), BEST_1,
        out=Expect((N[3], N[4]), resumes=N[4]),
        run=Expect((N[3], N[4], N[5]), resumes=N[5]), tiers=("durable",),
    ),
    "metrics_logged_by_some": Case(
        "plain",
        lambda r: [rewrite_metrics(r / N[s], lambda m: m.pop("loss")) for s in (2, 4)],
        BEST_1,
        out=Expect((N[3], N[4]), resumes=N[4]),
        run=Expect((N[3], N[4], N[5]), resumes=N[5]), tiers=("durable",),
    ),
    "superseded_line": Case(
        "rolled", _nothing, KEEP_1,
        out=Expect((N[3], ASIDE, N[4]), resumes=N[3]),
        run=Expect((N[3], ASIDE, N[4], N[5]), resumes=N[5]),
        store=Expect((N[3], ASIDE, N[4])), s3=True,
    ),
    "superseded_line_opted_in": Case(
        "rolled", _nothing, {"keep_last": 1, "superseded": True},
        out=Expect((N[3],), resumes=N[3]),
        run=Expect((N[3], N[5]), resumes=N[5]),
    ),
    "superseded_line_head_checkpoint_json_flipped": Case(
        # the new line's head is unreadable: the line it started still rules (the latest pointer
        # records it), so auto-resume falls back to 2, never to the abandoned 4, and 2 stays
        "rolled", lambda r: flip_a_bit(r / N[3] / CHECKPOINT_JSON), KEEP_1,
        out=Expect((N[2], ASIDE, N[4]), resumes=N[2]),
        run=Expect((N[2], ASIDE, N[4], N[5]), resumes=N[5]),
        foreign=(N[3],),
    ),
    "a_writer_holds_the_lock": Case(
        "plain", hold_lock, KEEP_1,
        out=Expect((N[1], N[2], N[3], N[4]), resumes=N[4], code=5),
        run=None,  # a run cannot start there
    ),
}


def seed_of(meta_or_metrics: dict[str, Any]) -> int:
    return int(meta_or_metrics["seed"])


def checkpoints(root: Path) -> list[str]:
    """The committed checkpoints listed there (a damaged checkpoint.json is not one)."""
    return sorted(i.name for i in LocalStorage(root).scan()[0])


def assert_loads(location: str, **load_kw: Any) -> None:
    """The checkpoint at ``location`` loads, and holds the weights its own step was saved with."""
    model = nn.Linear(2, 2)
    state = TrainState()
    with DefaultCheckpointManager(config(load_kw.pop("scratch"), **load_kw)) as mgr:
        result = mgr.load(LoadContext(model=model, train_state=state, path=location))
    assert state.step == result.step
    expected = weights(seed_of(result.metrics))
    for key, tensor in expected.items():
        assert torch.equal(model.state_dict()[key], tensor), (location, key)


def assert_each_loads(locations: dict[str, str], case: Case, scratch: Path, **load_kw: Any) -> None:
    """Every checkpoint left loads by path, but those the state damaged: they fail to load."""
    for left, location in locations.items():
        if left in case.broken:
            with pytest.raises(CheckpointCorruptError):
                assert_loads(location, scratch=scratch / uuid.uuid4().hex, verify_on_load="full", **load_kw)
        else:
            assert_loads(location, scratch=scratch / uuid.uuid4().hex, **load_kw)


def assert_outcome(root: Path, expect: Expect, case: Case, scratch: Path) -> None:
    assert checkpoints(root) == sorted(expect.left), "left on disk"
    for entry in case.foreign:
        assert (root / entry).is_dir(), f"{entry} was touched"
    assert_each_loads({left: str(root / left) for left in expect.left}, case, scratch)
    with DefaultCheckpointManager(config(root, verify_on_load="full", writer_lock=False)) as mgr:
        model = nn.Linear(2, 2)
        result = mgr.load(LoadContext(model=model, train_state=TrainState()))
    assert Path(result.path).name == expect.resumes
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights(seed_of(result.metrics)).items())


def prepared(templates: dict[str, Path], case: Case, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(templates[case.template], root)
    case.prepare(root)
    return root


def cli_args(rules: dict[str, Any], verify: str) -> list[str]:
    args = ["--verify", verify, "--yes", "--json"]
    for key, value in rules.items():
        flag = "--" + {"keep_last": "keep-last", "keep_best": "keep-best"}.get(key, key)
        args += [flag] if value is True else [flag, str(value)]
    return args


# -- outside a run: ckpt prune, prune() -------------------------------------------------------------
OUT_CASES = [k for k, c in CASES.items() if c.out is not None]


@pytest.mark.parametrize("case_name", OUT_CASES)
def test_ckpt_prune(case_name: str, templates: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = CASES[case_name]
    assert case.out is not None
    root = prepared(templates, case, tmp_path)
    before = checkpoints(root)
    code = main(["prune", str(root), *cli_args(case.rules, case.verify)])
    captured = capsys.readouterr()
    assert code == case.out.code, captured.err
    if code != 5:
        doc = json.loads(captured.out)
        assert sorted(d["name"] for d in doc["deleted"]) == sorted(set(before) - set(case.out.left))
        assert [d["name"] for d in doc["damaged"]] == list(case.out.damaged)
        for damaged in case.out.damaged:  # named on stderr too, with its problem
            assert f"ckpt prune: {damaged} (step " in captured.err and "is damaged and was kept" in captured.err
    else:
        (root / LOCK_FILE).unlink()
    assert_outcome(root, case.out, case, tmp_path)


@pytest.mark.parametrize("case_name", OUT_CASES)
def test_prune_function(case_name: str, templates: dict[str, Path], tmp_path: Path) -> None:
    from checkpoint_manager.storage.lock import CheckpointLockError

    case = CASES[case_name]
    assert case.out is not None
    root = prepared(templates, case, tmp_path)
    before = checkpoints(root)
    if case.out.code == 5:
        with pytest.raises(CheckpointLockError):
            prune(root, **case.rules, dry_run=False, verify=case.verify, fsync=False)  # type: ignore[arg-type]
        (root / LOCK_FILE).unlink()
    else:
        gone = prune(root, **case.rules, dry_run=False, verify=case.verify, fsync=False)  # type: ignore[arg-type]
        assert sorted(c.name for c in gone) == sorted(set(before) - set(case.out.left))
    assert_outcome(root, case.out, case, tmp_path)


# -- inside a run: the default manager's retention, and both tiers of the tiered manager ---------------
RUN_CASES = [k for k, c in CASES.items() if c.run is not None]


def run_config_fields(case: Case) -> dict[str, Any]:
    fields = dict(case.rules)
    fields["delete_superseded"] = fields.pop("superseded", False)
    return {"verify_on_load": case.verify, **fields}


def saves_once(mgr: Any) -> None:
    """Auto-resume, then one save (step 5), as a restarted run does."""
    model = nn.Linear(2, 2)
    state = TrainState()
    if mgr.should_load(LoadContext(model=model, train_state=state)):
        mgr.load(LoadContext(model=model, train_state=state))
    save(mgr, 5, RUN_SEED, loss=0.5)


@pytest.mark.parametrize("case_name", RUN_CASES)
def test_a_runs_retention(case_name: str, templates: dict[str, Path], tmp_path: Path) -> None:
    case = CASES[case_name]
    assert case.run is not None
    root = prepared(templates, case, tmp_path)
    with DefaultCheckpointManager(config(root, **run_config_fields(case))) as mgr:
        saves_once(mgr)
    assert_outcome(root, case.run, case, tmp_path)


TIER_CASES = [(k, tier) for k, c in CASES.items() if c.run is not None for tier in c.tiers]


@pytest.mark.parametrize(("case_name", "tier"), TIER_CASES, ids=[f"{k}-{t}" for k, t in TIER_CASES])
def test_a_tiered_runs_retention(case_name: str, tier: str, templates: dict[str, Path], tmp_path: Path) -> None:
    from checkpoint_manager import create_checkpoint_manager

    case = CASES[case_name]
    assert case.run is not None
    root = prepared(templates, case, tmp_path)
    other = tmp_path / "other"
    fields = run_config_fields(case)
    local_fields = {"local_keep_last": fields.pop("keep_last")} if tier == "local" else {}
    if tier == "local":
        fields = {k: v for k, v in fields.items() if k in ("verify_on_load", "delete_superseded")}
    tiered = {
        "manager": "tiered",
        "save_dir": str(root if tier == "durable" else other),
        "local_dir": str(root if tier == "local" else other),
        "fsync": False,
        "background_deletion": False,
        "durable_every_n_steps": 1000,
        **fields,
        **local_fields,
    }
    with create_checkpoint_manager(tiered) as mgr:  # type: ignore[attr-defined]
        saves_once(mgr)
    assert_outcome(root, case.run, case, tmp_path)


# -- the replica store ---------------------------------------------------------------------------------
STORE_CASES = [k for k, c in CASES.items() if c.store is not None]


def as_store(save_dir: Path, local_dir: Path) -> Any:
    """A one-rank replica store holding every checkpoint of ``save_dir`` (what a replication leaves)."""
    from cm_tiered.replicas import ReplicaStore, manifest_of

    store = ReplicaStore(local_dir, fsync=False)
    for ckpt in sorted(save_dir.iterdir()):
        if not (ckpt / CHECKPOINT_JSON).is_file():
            continue
        share = store.share(ckpt.name, 0)
        shutil.copytree(ckpt, share)
        meta = json.loads((ckpt / CHECKPOINT_JSON).read_text())
        store.write_marker(ckpt.name, {
            "step": meta["step"], "name": ckpt.name, "world_size": 1, "replicas": 1, "nodes": [0],
            "local_ranks": [0], "manifests": {"0": manifest_of(share, {})}, "lineage": meta.get("lineage"),
        })
    return store


STORE_DAMAGE: dict[str, Callable[[Path], None]] = {
    "intact": _nothing,
    "newest_truncated": lambda s: truncate(s / N[4] / "rank_00000"),
    "newest_bit_flipped": lambda s: flip_a_bit(data_file(s / N[4] / "rank_00000")),
    "newest_missing_a_file": lambda s: data_file(s / N[4] / "rank_00000").unlink(),
    "newest_without_checkpoint_json": lambda s: (s / N[4] / "committed.json").unlink(),  # its marker
    "superseded_line": _nothing,
}


@pytest.mark.parametrize("case_name", STORE_CASES)
def test_the_replica_stores_retention(case_name: str, templates: dict[str, Path], tmp_path: Path) -> None:
    case = CASES[case_name]
    assert case.store is not None
    store = as_store(templates[case.template], tmp_path / "local")
    STORE_DAMAGE[case_name](store.root)
    store.prune(case.rules["keep_last"], verify=case.verify)
    left = sorted(p.name for p in store.root.iterdir() if (p / "committed.json").is_file())
    assert left == sorted(case.store.left)
    assert sorted(store.names()) == sorted(set(case.store.left) | set(case.foreign))  # unfinished ones stay
    assert_each_loads({kept: str(store.share(kept, 0)) for kept in case.store.left}, case, tmp_path)


# -- object storage: ckpt prune on the moto S3 server ---------------------------------------------------
S3_CASES = [k for k, c in CASES.items() if c.s3]


@pytest.fixture
def s3(moto_s3: MotoS3) -> MotoS3:
    return moto_s3


@pytest.mark.parametrize("case_name", S3_CASES)
def test_ckpt_prune_on_object_storage(
    case_name: str, templates: dict[str, Path], tmp_path: Path, s3: MotoS3, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[case_name]
    assert case.out is not None
    root = prepared(templates, case, tmp_path)
    url = f"s3://{s3.make_bucket()}/run"
    options = storage_options(s3.endpoint)
    fs = fsspec.filesystem("s3", **options)
    fs.put(str(root) + "/", url.removeprefix("s3://") + "/", recursive=True)
    option_args = [f"-o=client_kwargs={json.dumps(options['client_kwargs'])}", f"-o=key={options['key']}",
                   f"-o=secret={options['secret']}"]
    code = main(["prune", url, *option_args, *cli_args(case.rules, case.verify)])
    captured = capsys.readouterr()
    assert code == case.out.code, captured.err
    doc = json.loads(captured.out)
    assert sorted(d["name"] for d in doc["deleted"]) == sorted(set(checkpoints(root)) - set(case.out.left))
    fs.invalidate_cache()
    left = sorted(p.rsplit("/", 2)[-2] for p in fs.find(url.removeprefix("s3://")) if p.endswith(f"/{CHECKPOINT_JSON}"))
    assert left == sorted(case.out.left)
    assert_each_loads({kept: f"{url}/{kept}" for kept in case.out.left}, case, tmp_path, storage_options=options)
    reader = config(url, storage_options=options, verify_on_load="full", writer_lock=False, sweep_pending_on_start=False)
    with DefaultCheckpointManager(reader) as mgr:
        result = mgr.load(LoadContext(model=nn.Linear(2, 2), train_state=TrainState()))
    assert result.path.rsplit("/", 1)[-1] == case.out.resumes


def test_the_matrix_covers_every_deleter_and_state() -> None:
    """The deleters and states the matrix promises (its docstring) are all driven."""
    assert len(OUT_CASES) == len(CASES) and len(RUN_CASES) == len(CASES) - 1
    assert {"newest_truncated", "newest_missing_a_file", "newest_without_checkpoint_json", "superseded_line"} <= set(S3_CASES)
    assert set(STORE_CASES) == set(STORE_DAMAGE)
    assert {t for _, t in TIER_CASES} == {"local", "durable"}
