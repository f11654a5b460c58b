"""Checkpoints in S3, against a real S3 server (moto's server mode) on loopback, with s3fs as the client.

Covers: save → load → resume (bit-exact) → retention on ``s3://``, sync and async, staged and
streamed uploads; discovery and pointers; a writer SIGKILLed at its commit point; transient failures
(a proxy failing every k-th request with 503) retried; a permanent one (403, no such bucket) raised
as is; credentials never logged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from checkpoint_manager import (
    AsyncSaveError,
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
    prune,
    verify,
)
from checkpoint_manager.storage import FsspecStorage, LocalStorage, open_storage
from checkpoint_manager.storage.lock import CheckpointLockError
from checkpoint_manager.storage.retry import RetryPolicy, is_transient
from tests.helpers.process import ROOT, child_env
from tests.helpers.s3_server import DUMMY_SECRET, FaultProxy, MotoS3, storage_options

CHILD_TIMEOUT_S = 90

S3_CHILD = ROOT / "tests" / "helpers" / "s3_child.py"


# -- a tiny deterministic training run -------------------------------------------------------------
@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainState

    def train_step(self) -> None:
        """One step on data that depends only on the step (so a resumed run sees the same batches)."""
        g = torch.Generator().manual_seed(1000 + self.state.step)
        x = torch.randn(8, 16, generator=g)
        loss = (self.model(x) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.state.step += 1
        self.state.counters["samples"] = self.state.counters.get("samples", 0) + 8

    def save_kwargs(self, **extra: Any) -> dict[str, Any]:
        loss = float(sum(p.detach().abs().sum() for p in self.model.parameters()))
        return dict(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            train_state=self.state,
            metrics={"loss": loss},
            **extra,
        )

    def load_context(self, **extra: Any) -> LoadContext:
        return LoadContext(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, train_state=self.state, **extra
        )

    def snapshot(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for pid, st in self.optimizer.state_dict()["state"].items():
            for k, v in st.items():
                out[f"optim/{pid}/{k}"] = torch.as_tensor(v).clone()
        out["sched/last_epoch"] = torch.tensor(self.scheduler.last_epoch)
        out["lr"] = torch.tensor(self.optimizer.param_groups[0]["lr"])
        out["state/step"] = torch.tensor(self.state.step)
        out["state/samples"] = torch.tensor(self.state.counters.get("samples", 0))
        return out


def make_run(seed: int = 0) -> Run:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return Run(model, optimizer, scheduler, TrainState())


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def s3_config(url: str, endpoint: str, staging: str | Path, **kw: Any) -> CheckpointConfig:
    """A config for ``url`` on the loopback server; botocore's own retries off, so ours are exercised."""
    kw.setdefault("fsync", False)
    return CheckpointConfig(
        save_dir=url,
        storage_options=storage_options(endpoint, botocore_retries=False),
        scratch_dir=str(staging),
        storage_retry_backoff_s=0.01,
        **kw,
    )


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture
def s3(moto_s3: MotoS3) -> MotoS3:
    return moto_s3


@pytest.fixture
def proxy(s3_proxy: FaultProxy) -> FaultProxy:
    return s3_proxy


@pytest.fixture
def url(s3: MotoS3) -> str:
    return f"s3://{s3.make_bucket()}/runs/exp1"


def objects(storage: FsspecStorage) -> list[str]:
    storage.fs.invalidate_cache()
    return sorted(str(p)[len(storage.root) + 1 :] for p in storage.fs.find(storage.root))


# -- the full cycle -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("async_save", "upload_mode"), [(False, "scratch"), (False, "stream"), (True, "scratch"), (True, "stream")]
)
def test_save_load_resume_retention(
    async_save: bool, upload_mode: str, s3: MotoS3, url: str, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    cfg = s3_config(
        url, s3.endpoint, staging, save_every_n_steps=2, keep_last=2, monitor="loss",
        async_save=async_save, upload_mode=upload_mode,
    )
    run = make_run()
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    losses: dict[int, float] = {}
    with DefaultCheckpointManager(cfg) as manager:
        for _ in range(8):
            run.train_step()
            result = manager.save(SaveContext(**run.save_kwargs()))
            if result is not None:
                assert result.path == f"{url}/step_{run.state.step:08d}"
                snapshots[run.state.step] = run.snapshot()
                losses[run.state.step] = run.save_kwargs()["metrics"]["loss"]
        manager.finalize_async_saves(blocking=True)
        infos = manager.list_checkpoints()
    final = run.snapshot()

    storage = open_storage(url, cfg.storage_options)
    assert isinstance(storage, FsspecStorage)
    # retention ran on the store: the best by loss and the newest two survive, the rest is deleted
    best_step = min(losses, key=lambda s: losses[s])
    kept = sorted({best_step, 6, 8})
    assert [i.step for i in infos] == kept
    assert [i.location for i in infos] == [f"{url}/step_{s:08d}" for s in kept]
    listed = objects(storage)
    assert {o.split("/")[0] for o in listed if o.startswith("step_")} == {f"step_{s:08d}" for s in kept}
    assert {k: v for k, v in (storage.read_pointer("latest") or {}).items() if k != "lineage"} == {"name": "step_00000008", "step": 8}
    best = storage.read_pointer("best")
    assert best is not None and best["name"] == f"step_{best_step:08d}"
    assert ".writer.lock" not in listed  # released at the end
    assert list((staging / ".pending").iterdir()) == []  # staging copies dropped once uploaded

    # load (full CRC check on the downloaded copy) is bit-exact, then resuming reproduces the run
    resumed = make_run(seed=1)
    load_cfg = s3_config(url, s3.endpoint, tmp_path / "staging2", verify_on_load="full", load_step=6)
    with DefaultCheckpointManager(load_cfg) as loader:
        loaded = loader.load(resumed.load_context())
    assert loaded.path == f"{url}/step_00000006" and loaded.step == 6
    assert_same(snapshots[6], resumed.snapshot())
    resumed.train_step()
    resumed.train_step()
    assert_same(final, resumed.snapshot())
    assert list((tmp_path / "staging2" / ".cache").iterdir()) == []  # the download is dropped after loading


def test_discovery_pointers_and_sweep(s3: MotoS3, url: str, tmp_path: Path) -> None:
    cfg = s3_config(url, s3.endpoint, tmp_path / "staging", save_every_n_steps=1)
    run = make_run()
    with DefaultCheckpointManager(cfg) as manager:
        for _ in range(2):
            run.train_step()
            manager.save(SaveContext(**run.save_kwargs()))
    storage = open_storage(url, cfg.storage_options)
    assert isinstance(storage, FsspecStorage) and not storage.is_local
    assert isinstance(open_storage(tmp_path / "local"), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}/local"), LocalStorage)
    # a prefix without its marker is pending: never listed; a user's folder is never swept
    storage.fs.pipe_file(storage.key("step_00000003", "rank_00000.json"), b"{}")
    storage.fs.pipe_file(storage.key("step_00000003", "__0_0.distcp"), b"partial")
    storage.fs.pipe_file(storage.key("notes", "readme.txt"), b"mine")
    infos, bad = storage.scan()
    assert ([i.name for i in infos], bad) == (["step_00000001", "step_00000002"], [])
    assert infos[1].meta["train_state"]["step"] == 2 and infos[1].url == f"{url}/step_00000002"
    assert {k: v for k, v in (storage.read_pointer("latest") or {}).items() if k != "lineage"} == {"name": "step_00000002", "step": 2}
    assert storage.read_pointer("best") is None
    # a damaged marker is reported, not listed
    storage.fs.pipe_file(storage.key("step_00000009", "checkpoint.json"), b"{not json")
    infos, bad = storage.scan()
    assert [i.name for i in infos] == ["step_00000001", "step_00000002"]
    assert len(bad) == 1 and bad[0][0] == "step_00000009" and "not valid JSON" in bad[0][1]
    storage.fs.rm(storage.key("step_00000009"), recursive=True)

    # a new writer sweeps the pending prefix, nothing else
    with DefaultCheckpointManager(cfg) as manager:
        assert [i.step for i in manager.list_checkpoints()] == [1, 2]
        explicit = make_run(seed=5)
        assert manager.load(explicit.load_context(path=f"{url}/step_00000001")).step == 1
        assert explicit.state.step == 1
    listed = objects(storage)
    assert not [o for o in listed if o.startswith("step_00000003/")]
    assert "notes/readme.txt" in listed

    # verify() takes a URL: sizes from a listing, CRC32s on a downloaded copy; messages name the store
    ckpt = f"{url}/step_00000002"
    assert verify(ckpt, "full", storage_options=cfg.storage_options) == []
    data = storage.key("step_00000002", "__0_0.distcp")
    original = bytes(storage.fs.cat_file(data))
    raw = bytearray(original)
    raw[-100] ^= 0xFF
    storage.fs.pipe_file(data, bytes(raw))
    assert verify(ckpt, "sizes", storage_options=cfg.storage_options) == []
    [problem] = verify(ckpt, "full", storage_options=cfg.storage_options)
    assert problem.startswith(f"{ckpt}/__0_0.distcp: CRC32 ") and problem.endswith("(corrupted)")
    storage.fs.pipe_file(data, bytes(raw[:-1]))
    [problem] = verify(ckpt, "sizes", storage_options=cfg.storage_options)
    assert problem == f"{ckpt}/__0_0.distcp: size {len(raw) - 1} bytes, checkpoint.json records {len(raw)} (truncated or altered)"
    assert verify(f"{url}/step_00000003", storage_options=cfg.storage_options) == [
        f"{url}/step_00000003/checkpoint.json: missing (not a committed checkpoint)"
    ]

    # prune() outside a run takes the store's writer lock and deletes from the store, never the
    # newest intact checkpoint: while the newest is truncated, step 1 stays
    assert prune(url, keep_last=1, dry_run=False, storage_options=cfg.storage_options) == []
    storage.fs.pipe_file(data, original)
    assert [c.name for c in prune(url, keep_last=1, storage_options=cfg.storage_options)] == ["step_00000001"]
    assert storage.list_names() == ["step_00000001", "step_00000002"]  # a dry run deletes nothing
    deleted = prune(url, keep_last=1, dry_run=False, storage_options=cfg.storage_options)
    assert [c.name for c in deleted] == ["step_00000001"]
    assert storage.list_names() == ["step_00000002"]
    assert not [o for o in objects(storage) if o.startswith("step_00000001/") or o == ".writer.lock"]


def test_writer_lock_on_the_store(s3: MotoS3, url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = s3_config(url, s3.endpoint, tmp_path / "staging", lock_stale_after_s=30)
    storage = open_storage(url, cfg.storage_options)
    assert isinstance(storage, FsspecStorage)
    other = {
        "pid": 4242, "host": "another-host", "started": "2026-01-01T00:00:00Z", "started_unix": 0.0,
        "token": "t" * 32, "command": "train.py", "heartbeat_unix": time.time(),
    }
    storage.fs.pipe_file(storage.key(".writer.lock"), json.dumps(other).encode())
    with pytest.raises(CheckpointLockError, match=r"already being written by another run: pid 4242 on host another-host"):
        DefaultCheckpointManager(cfg)
    other["heartbeat_unix"] = time.time() - 600  # its heartbeat stopped: stale, taken over
    storage.fs.pipe_file(storage.key(".writer.lock"), json.dumps(other).encode())
    with caplog.at_level(logging.WARNING, logger="checkpoint_manager"):
        manager = DefaultCheckpointManager(cfg)
    assert re.search(r"taking over the writer lock of s3://\S+: its owner \(pid 4242 on host another-host.*\) "
                     r"has not refreshed it for 6\d\ds \(stale after 30s\)", caplog.text)
    owner = json.loads(storage.fs.cat_file(storage.key(".writer.lock")))
    assert owner["pid"] == os.getpid()
    manager.finalize_async_saves(terminate=True)
    storage.fs.invalidate_cache()
    assert not storage.fs.exists(storage.key(".writer.lock"))


# -- crashes and failures -------------------------------------------------------------------------------
@pytest.mark.parametrize("upload_mode", ["scratch"])
def test_kill_during_upload_is_never_listed(
    upload_mode: str, s3: MotoS3, proxy: FaultProxy, url: str, tmp_path: Path
) -> None:
    """SIGKILL while step 2's marker is in flight: step 2 is pending (listed never), step 1 loads,
    and the next writer sweeps step 2's prefix."""
    proxy.stall = lambda method, path: method == "PUT" and path.endswith("step_00000002/checkpoint.json")
    log = tmp_path / "child.log"  # a file, not a pipe: a full pipe would block the child
    with open(log, "wb") as sink:
        child = subprocess.Popen(
            [sys.executable, str(S3_CHILD), "kill", proxy.endpoint, url, str(tmp_path / "child"),
             upload_mode],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )
    try:
        if not proxy.stalled.wait(CHILD_TIMEOUT_S):
            child.kill()
            child.wait(timeout=30)
            pytest.fail(f"the child never reached step 2's commit:\n{log.read_text()[-4000:]}")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    proxy.release.set()  # the held request is dropped, never forwarded
    assert child.returncode == -signal.SIGKILL

    cfg = s3_config(url, s3.endpoint, tmp_path / "staging", sweep_pending_on_start=False)
    storage = open_storage(url, cfg.storage_options)
    assert isinstance(storage, FsspecStorage)
    pending = [o for o in objects(storage) if o.startswith("step_00000002/")]
    assert "step_00000002/rank_00000.json" in pending and "step_00000002/checkpoint.json" not in pending
    assert storage.list_names() == ["step_00000001"]
    assert {k: v for k, v in (storage.read_pointer("latest") or {}).items() if k != "lineage"} == {"name": "step_00000001", "step": 1}

    expected = make_run()
    expected.train_step()
    restored = make_run(seed=3)
    with DefaultCheckpointManager(cfg) as manager:  # takes over the dead child's lock
        assert [i.step for i in manager.list_checkpoints()] == [1]
        assert manager.load(restored.load_context()).step == 1
    assert_same(expected.snapshot(), restored.snapshot())

    with DefaultCheckpointManager(s3_config(url, s3.endpoint, tmp_path / "staging")):
        pass  # the start sweep
    assert not [o for o in objects(storage) if o.startswith("step_00000002/")]


def test_two_ranks_each_upload_their_shard(s3: MotoS3, url: str, tmp_path: Path) -> None:
    """A real 2-rank gloo job with an FSDP2-sharded model: each rank uploads its own shard file, rank 0
    writes the marker listing both with their CRC32s, and every local shard loads back bit-exact."""
    env_base = {**os.environ, "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}
    store = tmp_path / "store"
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    children = []
    for rank in range(2):
        with open(logs[rank], "wb") as sink:  # files, not pipes: a full pipe would block a rank
            children.append(subprocess.Popen(
                [sys.executable, str(S3_CHILD), "rank", s3.endpoint, url, str(tmp_path / "staging"),
                 str(store), str(tmp_path / f"rank{rank}.json")],
                env={**env_base, "RANK": str(rank)}, stdout=sink, stderr=subprocess.STDOUT,
            ))
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        for child in children:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    assert [c.returncode for c in children] == [0, 0], "\n".join(p.read_text()[-3000:] for p in logs)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["equal"] and report["step"] == 3 and report["path"] == f"{url}/step_00000003"
        assert report["numel"] > 0
    storage = open_storage(url, storage_options(s3.endpoint))
    assert isinstance(storage, FsspecStorage)
    files = [o for o in objects(storage) if o.startswith("step_00000003/")]
    assert {"step_00000003/__0_0.distcp", "step_00000003/__1_0.distcp", "step_00000003/rank_00000.json",
            "step_00000003/rank_00001.json", "step_00000003/checkpoint.json"} <= set(files)
    meta = json.loads(storage.fs.cat_file(storage.key("step_00000003", "checkpoint.json")))
    assert meta["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])
    assert all("crc32" in entry for entry in meta["files"].values())


@pytest.mark.parametrize(("async_save", "upload_mode"), [(False, "scratch"), (True, "stream")])
def test_transient_failures_are_retried(
    async_save: bool, upload_mode: str, s3: MotoS3, proxy: FaultProxy, url: str, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = s3_config(
        url, proxy.endpoint, tmp_path / "staging", save_every_n_steps=1, keep_last=1,
        async_save=async_save, upload_mode=upload_mode, verify_on_load="full",
    )
    run = make_run()
    proxy.fail_every = 3  # every third request to the store fails with 503
    with caplog.at_level(logging.DEBUG, logger="checkpoint_manager"), DefaultCheckpointManager(cfg) as manager:
        for _ in range(3):
            run.train_step()
            manager.save(SaveContext(**run.save_kwargs()))
        manager.finalize_async_saves(blocking=True)
        restored = make_run(seed=7)
        assert manager.load(restored.load_context()).step == 3
    assert proxy.injected >= 10
    assert_same(run.snapshot(), restored.snapshot())
    assert "transient error (OSError: [Errno 16] Service temporarily unavailable" in caplog.text
    # credentials appear in no log line, no repr
    assert DUMMY_SECRET not in caplog.text
    assert DUMMY_SECRET not in repr(cfg) and DUMMY_SECRET not in str(cfg)
    assert DUMMY_SECRET not in repr(open_storage(url, cfg.storage_options))
    proxy.fail_every = 0
    storage = open_storage(url, cfg.storage_options)
    assert isinstance(storage, FsspecStorage)
    assert storage.list_names() == ["step_00000003"]


@pytest.mark.parametrize(("async_save", "upload_mode"), [(False, "scratch"), (True, "scratch"), (True, "stream")])
def test_permanent_failure_surfaces_and_commits_nothing(
    async_save: bool, upload_mode: str, s3: MotoS3, proxy: FaultProxy, url: str, tmp_path: Path
) -> None:
    cfg = s3_config(
        url, proxy.endpoint, tmp_path / "staging", save_every_n_steps=1, async_save=async_save,
        upload_mode=upload_mode,
    )
    run = make_run()
    proxy.deny = lambda method, path: method == "PUT" and ".distcp" in path  # e.g. a bucket policy
    manager = DefaultCheckpointManager(cfg)
    run.train_step()
    if async_save:
        manager.save(SaveContext(**run.save_kwargs()))
        with pytest.raises(
            AsyncSaveError, match=r"^the async save of step 1 \(not committed\) failed: PermissionError: Access Denied$"
        ) as info:
            manager.finalize_async_saves(blocking=True)
        assert isinstance(info.value.__cause__, PermissionError)
    else:
        with pytest.raises(PermissionError, match=r"^Access Denied$"):
            manager.save(SaveContext(**run.save_kwargs()))
    assert proxy.denied == 1  # a permanent error is not retried
    proxy.deny = None
    storage = open_storage(url, cfg.storage_options)
    assert isinstance(storage, FsspecStorage)
    assert storage.list_names() == [] and storage.read_pointer("latest") is None
    assert not [o for o in objects(storage) if o.startswith("step_")]  # the pending prefix is gone
    assert list((tmp_path / "staging" / ".pending").iterdir()) == []
    # the next save works
    run.train_step()
    manager.save(SaveContext(**run.save_kwargs()))
    manager.finalize_async_saves(blocking=True, terminate=True)
    assert storage.list_names() == ["step_00000002"]


def test_missing_bucket_is_a_permanent_error(s3: MotoS3, tmp_path: Path) -> None:
    cfg = s3_config("s3://no-such-bucket-3f1c/run", s3.endpoint, tmp_path / "staging")
    with pytest.raises(FileNotFoundError, match="bucket"):
        DefaultCheckpointManager(cfg)


# -- units: retry classification, config ----------------------------------------------------------------
def test_retry_classification() -> None:
    import errno

    class ClientError(Exception):
        def __init__(self, status: int, code: str) -> None:
            super().__init__(code)
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    def translated(status: int, code: str, exc_type: type[OSError], *args: Any) -> OSError:
        exc = exc_type(*args)
        exc.__cause__ = ClientError(status, code)
        return exc

    assert is_transient(translated(503, "SlowDown", OSError, errno.EBUSY, "slow down"))
    assert is_transient(translated(500, "InternalError", OSError, errno.EIO, "internal"))
    assert is_transient(translated(400, "RequestTimeout", OSError, errno.EIO, "timeout"))
    assert not is_transient(translated(403, "AccessDenied", PermissionError, "Access Denied"))
    assert not is_transient(translated(404, "NoSuchBucket", FileNotFoundError, "no bucket"))
    assert is_transient(TimeoutError("read timed out"))
    assert is_transient(ConnectionResetError("reset"))
    assert not is_transient(ValueError("bad"))

    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("slow")
        return "ok"

    assert RetryPolicy(attempts=3, backoff_s=0).call(flaky, "op") == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(TimeoutError, match="slow") as info:
        RetryPolicy(attempts=2, backoff_s=0).call(flaky, "op")
    assert len(calls) == 2 and "op failed 2 times" in "".join(info.value.__notes__)
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        RetryPolicy(attempts=0)


def test_config_fields_validate_and_hide_credentials(tmp_path: Path) -> None:
    cfg = CheckpointConfig(save_dir="s3://b/p", storage_options={"secret": DUMMY_SECRET})
    assert DUMMY_SECRET not in repr(cfg) and cfg.storage_options == {"secret": DUMMY_SECRET}
    assert "storage_options" not in cfg.model_dump() and DUMMY_SECRET not in cfg.model_dump_json()
    assert (cfg.upload_mode, cfg.storage_retries, cfg.storage_retry_backoff_s, cfg.scratch_dir) == (
        "scratch", 4, 0.5, None,
    )
    with pytest.raises(ValidationError, match="upload_mode"):
        CheckpointConfig(save_dir="s3://b/p", upload_mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="storage_retries"):
        CheckpointConfig(save_dir="s3://b/p", storage_retries=-1)
    with pytest.raises(ValidationError, match="storage_retries must be an integer, not a boolean"):
        CheckpointConfig(save_dir="s3://b/p", storage_retries=True)
    with pytest.raises(ValidationError, match="scratch_dir must be a local directory"):
        CheckpointConfig(save_dir="s3://b/p", scratch_dir="s3://b/scratch")
    with pytest.raises(ValueError, match="upload_mode must be 'scratch' or 'stream'"):
        FsspecStorage("memory://x", upload_mode="fast")  # type: ignore[arg-type]
