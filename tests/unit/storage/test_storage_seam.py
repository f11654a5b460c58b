"""The storage seam: everything above storage/ works through the Storage protocol alone.

A storage that is neither LocalStorage nor FsspecStorage (a delegating wrapper) gets retention,
pointers, symlinks and the writer lock; deletion has one spelling, and a crash leftover of either
spelling is swept and retried; ``open_output`` streams (and discards a failed file); the streaming
DCP writer writes through it and restarts a file on a transient failure.
"""

from __future__ import annotations

import ast
import io
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint_manager.core.integrity import verify
from checkpoint_manager.core.layout import CHECKPOINT_JSON, FORMAT_NAME, FORMAT_VERSION, PENDING_DIR
from checkpoint_manager.core.naming import LATEST_LINK
from checkpoint_manager.engine.dcp.stream_writer import StreamingWriter
from checkpoint_manager.lifecycle.pointers import Pointers
from checkpoint_manager.lifecycle.retention import KeepLast, Pruner
from checkpoint_manager.storage import FsspecStorage, LocalStorage, Storage, open_storage
from checkpoint_manager.storage.base import DELETING, deleted_name, is_deleting
from checkpoint_manager.storage.lock import CheckpointLockError
from tests.helpers.process import ROOT
from tests.helpers.s3_server import MotoS3, storage_options

_T = TypeVar("_T")
_clock = itertools.count(1)
PACKAGE = ROOT / "checkpoint_manager"


def commit(storage: Storage, step: int) -> str:
    """Commit a small checkpoint the way the manager does (pending dir, marker, commit)."""
    name = f"step_{step:08d}"
    pending = storage.new_pending(name)
    with storage.open_output(pending, "__0_0.distcp") as out:
        out.write(b"x" * 64)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "name": name,
        "created_unix": float(next(_clock)),
        "metrics": {},
        "files": storage.describe_files(pending, {}),
    }
    storage.write_json(pending / CHECKPOINT_JSON, meta)
    return Path(storage.commit(pending, name)).name


class Delegating:
    """A Storage of its own kind: every call goes to a LocalStorage it holds (no subclassing)."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalStorage(root)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_storage_of_another_kind_gets_retention_pointers_and_the_lock(tmp_path: Path) -> None:
    storage: Any = Delegating(tmp_path / "run")
    assert isinstance(storage, Storage) and not isinstance(storage, LocalStorage | FsspecStorage)
    for step in (1, 2, 3):
        commit(storage, step)
    pruner = Pruner(storage, KeepLast(1))
    infos = pruner.scan()
    Pointers(storage, monitor=None, mode="min", symlinks=True).refresh(infos)
    plan = pruner.after_commit(infos=infos)
    assert [c.name for c in plan.delete] == ["step_00000001", "step_00000002"] and plan.failed == []
    # no metric is monitored: no best, so no best symlink
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".pending", LATEST_LINK, "step_00000003"]
    assert os.readlink(tmp_path / "run" / LATEST_LINK) == "step_00000003"
    assert list((tmp_path / "run" / PENDING_DIR).iterdir()) == []
    with storage.writer_lock() as lock:
        assert lock.held
        with pytest.raises(CheckpointLockError, match="already being written"):
            _other_process_takes(tmp_path / "run")
    assert not lock.held


def _other_process_takes(root: Path) -> None:
    """Take the writer lock of ``root`` from a forked child; raise its error here."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            LocalStorage(root).writer_lock().acquire()
            message = b"acquired"
        except CheckpointLockError as exc:
            message = str(exc).encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode()
    os.waitpid(pid, 0)
    if message != "acquired":
        raise CheckpointLockError(message)


# -- deletion: one spelling, both swept and retried -----------------------------------------------------
OLD_SPELLING = "step_00000005.deleting.abcd1234"
NEW_SPELLING = f"step_00000006.{DELETING}abcd1234"


def _leftover(storage: LocalStorage, entry: str) -> Path:
    path = storage.pending_root / entry
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "data").write_bytes(b"x")
    return path


def test_deletion_names_parse_in_either_spelling() -> None:
    assert deleted_name(OLD_SPELLING) == "step_00000005"
    assert deleted_name(NEW_SPELLING) == "step_00000006"
    assert deleted_name("step_00000007.0123456789ab") is None  # a save in flight
    assert not is_deleting("step_00000007.deleting.0123456789ab")  # 12 hex: a save named *.deleting.*


def test_every_deleter_uses_the_one_spelling(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "run")
    commit(storage, 1)
    commit(storage, 2)
    hidden = Path(storage.hide("step_00000001"))
    assert hidden.parent == storage.pending_root and hidden.name.startswith(f"step_00000001.{DELETING}")
    assert storage.unfinished_deletions() == [str(hidden)]
    storage.purge(str(hidden))
    assert not hidden.exists() and storage.unfinished_deletions() == []
    storage.delete_checkpoint("step_00000002")  # the CLI's and the manager's path
    assert storage.list_names() == [] and list(storage.pending_root.iterdir()) == []


@pytest.mark.parametrize("entry", [OLD_SPELLING, NEW_SPELLING])
def test_a_crash_leftover_of_either_spelling_is_swept(tmp_path: Path, entry: str) -> None:
    storage = LocalStorage(tmp_path / "run")
    commit(storage, 1)
    leftover = _leftover(storage, entry)
    assert storage.sweep_pending() == [entry]
    assert not leftover.exists() and storage.list_names() == ["step_00000001"]


@pytest.mark.parametrize("entry", [OLD_SPELLING, NEW_SPELLING])
def test_a_crash_leftover_of_either_spelling_is_retried_by_the_next_prune(tmp_path: Path, entry: str) -> None:
    storage = LocalStorage(tmp_path / "run")
    commit(storage, 1)
    leftover = _leftover(storage, entry)
    in_flight = storage.new_pending("step_00000002")  # a save in flight: never touched
    Pruner(storage, KeepLast(1)).prune()
    assert not leftover.exists() and in_flight.exists()
    assert storage.list_names() == ["step_00000001"]


def test_a_deletion_leftover_is_listed_as_deleting_in_either_spelling(tmp_path: Path) -> None:
    from checkpoint_manager.cli.list_cmd import collect
    from checkpoint_manager.cli.output import Output

    storage = LocalStorage(tmp_path / "run")
    commit(storage, 1)
    _leftover(storage, OLD_SPELLING)
    _leftover(storage, NEW_SPELLING)
    doc = collect(storage.root, None, Output(json_mode=True, stdout=io.StringIO()))
    rows = {(r["name"], r["state"]) for r in doc["checkpoints"]}
    assert {("step_00000005", "deleting"), ("step_00000006", "deleting"), ("step_00000001", "committed")} <= rows


# -- open_output and the streaming writer --------------------------------------------------------------
def test_local_open_output_is_the_pending_file(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "run")
    assert storage.streams is False
    pending = storage.new_pending("step_00000001")
    with storage.open_output(pending, "sub/file.bin") as out:
        out.write(b"abc")
    assert (pending / "sub" / "file.bin").read_bytes() == b"abc"


@pytest.fixture
def s3(moto_s3: MotoS3) -> MotoS3:
    return moto_s3


def test_stream_open_output_uploads_on_close_and_discards_on_error(s3: MotoS3, tmp_path: Path) -> None:
    url = f"s3://{s3.make_bucket()}/run"
    options = storage_options(s3.endpoint)
    storage = open_storage(url, options, scratch_dir=tmp_path / "staging", upload_mode="stream")
    assert storage.streams is True
    assert open_storage(url, options, scratch_dir=tmp_path / "staging2").streams is False  # "scratch"
    pending = storage.new_pending("step_00000001")
    with storage.open_output(pending, "__0_0.distcp") as out:
        out.write(b"tensor bytes")
    assert isinstance(storage, FsspecStorage)
    remote = storage.remote_dir(pending)
    assert storage.fs.cat_file(f"{remote}/__0_0.distcp") == b"tensor bytes"
    assert not (pending / "__0_0.distcp").exists()  # never on the local disk
    with pytest.raises(RuntimeError, match=r"^mid-file$"), storage.open_output(pending, "__1_0.distcp") as out:
        out.write(b"half")
        raise RuntimeError("mid-file")
    storage.fs.invalidate_cache()
    assert not storage.fs.exists(f"{remote}/__1_0.distcp")  # no partial object


class Flaky(ConnectionError):
    """A dropped connection: transient."""


def test_streaming_writer_restarts_a_file_after_a_transient_failure(tmp_path: Path) -> None:
    """The writer writes through ``open_output``; a failure mid-file restarts it from its first byte
    under ``retry``, and the recorded size and CRC32 are the file's."""
    storage = LocalStorage(tmp_path / "run")
    pending = storage.new_pending("step_00000001")
    opened: list[str] = []

    def open_output(rel: str) -> BinaryIO:
        opened.append(rel)
        out = storage.open_output(pending, rel)
        if len(opened) == 1:  # the first attempt dies after a few bytes
            real_write = out.write

            def write(data: Any) -> int:
                real_write(data[:10])
                raise Flaky("connection reset")

            out.write = write  # type: ignore[method-assign]
        return out

    attempts: list[str] = []

    def retry(fn: Callable[[], _T], what: str) -> _T:
        for attempt in range(3):
            try:
                return fn()
            except Flaky:
                attempts.append(what)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 4)}
    writer = StreamingWriter(pending, open_output, retry=retry)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert opened == ["__0_0.distcp", "__0_0.distcp"] and attempts == ["write __0_0.distcp"]
    record = writer.checksums["__0_0.distcp"]
    assert record["size"] == (pending / "__0_0.distcp").stat().st_size
    files = storage.describe_files(pending, {})
    assert files["__0_0.distcp"] == {"size": record["size"], "crc32": record["crc32"]}
    loaded = {"w": torch.zeros(1000), "b": torch.zeros(3, 4)}
    dcp.load(loaded, checkpoint_id=str(pending), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


def test_the_public_verify_takes_paths_and_urls(tmp_path: Path) -> None:
    from checkpoint_manager import verify as public_verify

    storage = LocalStorage(tmp_path / "run")
    name = commit(storage, 1)
    assert public_verify(tmp_path / "run" / name) == [] == verify(tmp_path / "run" / name)
    url = f"memory://seam-{os.getpid()}-{next(_clock)}/run"
    remote = open_storage(url, scratch_dir=tmp_path / "staging")
    remote_name = commit(remote, 1)
    assert public_verify(f"{url}/{remote_name}", "full") == []
    assert public_verify(f"{url}/step_00000009") == [f"{url}/step_00000009/{CHECKPOINT_JSON}: missing (not a committed checkpoint)"]


# -- no kind dispatch above storage/ --------------------------------------------------------------------
def test_no_isinstance_on_storage_kinds_outside_storage() -> None:
    kinds = {"LocalStorage", "FsspecStorage"}
    found: list[str] = []
    for file in PACKAGE.rglob("*.py"):
        if file.parent.name == "storage":
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) > 1 else set()
                if named & kinds:
                    found.append(f"{file.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []


def test_prune_refuses_a_root_that_holds_nothing_local_or_remote(s3: MotoS3, tmp_path: Path) -> None:
    from checkpoint_manager.lifecycle.retention import prune

    with pytest.raises(FileNotFoundError, match=r"is not a directory \(nothing is stored there\)$"):
        prune(tmp_path / "missing", keep_last=1, dry_run=False)
    url = f"s3://{s3.make_bucket()}/missing"
    options = storage_options(s3.endpoint)
    with pytest.raises(FileNotFoundError, match=r"is not a directory \(nothing is stored there\)$"):
        prune(url, keep_last=1, dry_run=False, storage_options=options)
    assert open_storage(url, options).is_present() is False  # no lock object was left behind


@pytest.mark.parametrize("raw", [b'{"name": "../outside"}', b'{"name": "a/b"}', b'{"name": ""}', b'{"name": ".."}', b"[1]", b"\xff{", b"{"])
def test_one_pointer_parser_for_storage_and_resolver(tmp_path: Path, raw: bytes) -> None:
    from checkpoint_manager.errors import CheckpointCorruptError
    from checkpoint_manager.formats.resolve import resolve_checkpoint

    storage = LocalStorage(tmp_path / "run")
    commit(storage, 1)
    (storage.root / "latest").write_bytes(b'{"name": "step_00000001", "step": 1}')
    assert storage.read_pointer("latest") == {"name": "step_00000001", "step": 1}
    assert resolve_checkpoint(storage.root / "latest").step == 1
    (storage.root / "latest").write_bytes(raw)
    assert storage.read_pointer("latest") is None
    with pytest.raises(CheckpointCorruptError, match=r"latest: not a latest pointer \(no checkpoint name in it\)$"):
        resolve_checkpoint(storage.root / "latest")
