"""What a checkpoint path may name, decided in one place for the library and the command line.

A path or URL given to ``LoadContext(path=...)``, ``initial_load_path``, ``load_dir``, the formats
functions (``export_hf``, ``convert``, ``pack_bundle``, ...) or any ``ckpt`` command means:

* a **save directory**: its newest committed checkpoint (or the one of ``step``);
* a **checkpoint directory** of ours (``checkpoint.json`` inside);
* a ``latest`` / ``best`` **pointer file** of a save directory: the checkpoint it names;
* a **bundle** (``.tar``): the checkpoint inside, unpacked into the cache;
* a **plain DCP directory** (DCP's files, no ``checkpoint.json``), as ``dcp.save`` writes;
* an fsspec **URL** (``s3://bucket/run`` or ``s3://bucket/run/step_00000100``): the same rules in
  the object store.

A path that does not exist raises :class:`CheckpointNotFoundError` naming it; only a checkpoint
that is there but damaged raises :class:`CheckpointCorruptError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from checkpoint_manager.core.layout import CHECKPOINT_JSON, POINTER_LIMIT, pick_step
from checkpoint_manager.core.naming import BEST_POINTER, LATEST_POINTER
from checkpoint_manager.engine.reading import plain_engine
from checkpoint_manager.errors import CheckpointCorruptError, CheckpointNotFoundError
from checkpoint_manager.storage.base import is_url

if TYPE_CHECKING:
    from checkpoint_manager.core.layout import CheckpointInfo
    from checkpoint_manager.storage import Storage

__all__ = [
    "CheckpointKind",
    "ResolvedCheckpoint",
    "is_plain_dcp",
    "local_checkpoint",
    "newest_committed",
    "resolve_checkpoint",
    "resolve_checkpoint_path",
    "resolve_remote",
]

#: ``committed``: a checkpoint directory of ours; ``plain_dcp``: what ``dcp.save`` wrote, without our
#: ``checkpoint.json``; ``bundle``: a ``.tar`` holding one of ours; ``remote``: one of ours at a URL.
CheckpointKind = Literal["committed", "plain_dcp", "bundle", "remote"]

_POINTERS = (LATEST_POINTER, BEST_POINTER)


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """One checkpoint, found from whatever the caller named, and how it was found.

    ``path`` is the checkpoint's directory: for a bundle its unpacked copy, for a URL its key in the
    store (use :func:`local_checkpoint` for a local copy). ``step`` is None for plain DCP, which
    records none.
    """

    kind: CheckpointKind
    path: Path
    step: int | None
    given: str
    meta: Mapping[str, Any] = field(default_factory=dict, repr=False)
    via: str | None = None  # "newest in runs/exp1", "step 10 of runs/exp1", "bundle", "latest pointer"
    url: str | None = None  # remote: the checkpoint's URL
    bundle: Path | None = None  # bundle: the .tar file

    @property
    def location(self) -> str:
        """What to load: the URL, the bundle file (each rank unpacks it), or the directory."""
        if self.url is not None:
            return self.url
        if self.bundle is not None:
            return str(self.bundle)
        return str(self.path)

    @property
    def committed(self) -> bool:
        """Whether it carries our ``checkpoint.json`` (plain DCP does not)."""
        return self.kind != "plain_dcp"


def is_plain_dcp(path: str | Path) -> bool:
    """A directory ``dcp.save`` wrote: a built-in engine's own files (:func:`plain_engine`), none of ours."""
    p = Path(path)
    return p.is_dir() and not _has_ours(p) and plain_engine(p) is not None


def _has_ours(path: Path) -> bool:
    from checkpoint_manager.core.layout import CHECKPOINT_JSON, STATE_JSON, rank_file

    return any((path / name).exists() for name in (CHECKPOINT_JSON, STATE_JSON, rank_file(0)))


def newest_committed(storage: Storage) -> CheckpointInfo | None:
    """The checkpoint a save directory stands for: the newest committed one of its current line, as
    discovery ranks them (the newest listed may be off the line when its head's record is damaged)."""
    infos, _bad = storage.scan()
    line = [i for i in infos if not i.superseded]
    return line[-1] if line else None


def resolve_checkpoint(
    path_or_url: str | Path,
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    verify_checksum: bool = True,
) -> ResolvedCheckpoint:
    """The checkpoint ``path_or_url`` names (see the module's list); ``step`` picks one of a save directory.

    ``verify_checksum=False`` (a load at ``verify_on_load="off"``) skips the ``checksum`` check of the
    ``checkpoint.json`` of a local checkpoint named directly (a checkpoint directory, a pointer, a
    bundle); discovery in a save directory always checks it.

    Raises :class:`CheckpointNotFoundError` (nothing there, no committed checkpoint, no such step),
    :class:`CheckpointCorruptError` (there, but damaged).
    """
    from checkpoint_manager.storage import is_url

    given = str(path_or_url)
    if is_url(given):
        return resolve_remote(given, step, storage_options)[0]
    text = given
    for scheme in ("file://", "local://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
    path = Path(text)
    if not path.exists():
        what = "a symlink to nothing" if path.is_symlink() else "no such file or directory"
        raise CheckpointNotFoundError(f"{given}: {what}")
    if path.is_file():
        return _resolve_file(given, path, step, verify_checksum)
    return _resolve_dir(given, path, step, verify_checksum)


def _resolve_file(given: str, path: Path, step: int | None, verify_checksum: bool = True) -> ResolvedCheckpoint:
    from checkpoint_manager.core.layout import read_checkpoint_json
    from checkpoint_manager.formats.bundle import is_bundle, open_bundle

    if path.name in _POINTERS:
        return _resolve_pointer(given, path, step, verify_checksum)
    if not is_bundle(path):
        raise CheckpointNotFoundError(f"{given}: a file, but not a checkpoint bundle (.tar)")
    checkpoint = open_bundle(path).checkpoint
    meta = read_checkpoint_json(checkpoint, verify_checksum=verify_checksum)
    _check_step(given, int(meta["step"]), step, "a bundle")
    return ResolvedCheckpoint("bundle", checkpoint, int(meta["step"]), given, meta, via="bundle", bundle=path)


def _resolve_pointer(given: str, path: Path, step: int | None, verify_checksum: bool = True) -> ResolvedCheckpoint:
    """A save directory's ``latest`` / ``best`` file: the committed checkpoint it names."""
    from checkpoint_manager.core.safe_io import read_small
    from checkpoint_manager.storage.base import parse_pointer

    try:
        data = parse_pointer(read_small(path, limit=POINTER_LIMIT, follow=True))
    except OSError as exc:
        raise CheckpointCorruptError(f"{given}: not a readable {path.name} pointer ({exc})") from exc
    if data is None:
        raise CheckpointCorruptError(f"{given}: not a {path.name} pointer (no checkpoint name in it)")
    name = data["name"]
    target = path.parent / name
    if not target.is_dir():
        raise CheckpointNotFoundError(f"{given}: names {name}, which is not in {path.parent} (pruned?)")
    resolved = _resolve_dir(str(target), target, step, verify_checksum)
    return dataclasses.replace(resolved, given=given, via=f"{path.name} pointer of {path.parent}")


def _resolve_dir(given: str, path: Path, step: int | None, verify_checksum: bool = True) -> ResolvedCheckpoint:
    from checkpoint_manager.core.layout import CHECKPOINT_JSON, STATE_JSON, rank_file, read_checkpoint_json

    if (path / CHECKPOINT_JSON).exists():
        meta = read_checkpoint_json(path, verify_checksum=verify_checksum)
        _check_step(given, int(meta["step"]), step, "one checkpoint")
        return ResolvedCheckpoint("committed", path, int(meta["step"]), given, meta)
    if plain_engine(path) is not None:
        if (path / STATE_JSON).exists() or (path / rank_file(0)).exists():
            raise CheckpointCorruptError(
                f"{path / CHECKPOINT_JSON}: missing (not a committed checkpoint); its files are a save of ours "
                "that never committed (interrupted, or copied before it finished)"
            )
        if step is not None:
            raise CheckpointNotFoundError(
                f"{given}: a plain DCP checkpoint, which records no step; step={step} applies to save directories"
            )
        return ResolvedCheckpoint("plain_dcp", path, None, given, via="plain DCP directory")
    from checkpoint_manager.storage import LocalStorage

    storage = LocalStorage(path)
    infos, bad = storage.scan()
    if infos:
        if step is None:
            newest = newest_committed(storage)
            assert newest is not None
            return _from_info(given, newest, f"newest in {given}")
        match = pick_step(infos, step)  # the current line's when a superseded one has the same step
        if match is not None:
            return _from_info(given, match, f"step {step} of {given}")
        steps = ", ".join(str(i.step) for i in infos)
        raise CheckpointNotFoundError(f"{given}: no checkpoint at step {step} (steps here: {steps})")
    if bad:
        name, problem = bad[-1]
        raise CheckpointCorruptError(f"{given}: holds no intact committed checkpoint; {name}: {problem}")
    plain = sorted(n for n in storage.list_names() if is_plain_dcp(path / n))
    hint = f"; plain DCP checkpoints inside: {', '.join(plain[:5])} (name one)" if plain else ""
    raise CheckpointNotFoundError(f"{given}: no committed checkpoint here (not a checkpoint or save directory){hint}")


def _from_info(given: str, info: CheckpointInfo, via: str) -> ResolvedCheckpoint:
    return ResolvedCheckpoint("committed", info.path, info.step, given, info.meta, via=via)


def _check_step(given: str, actual: int, step: int | None, what: str) -> None:
    if step is not None and step != actual:
        raise CheckpointNotFoundError(
            f"{given}: {what}, of step {actual}, not step {step} (a step picks among a save directory's checkpoints)"
        )


def resolve_remote(
    url: str, step: int | None, storage_options: dict[str, Any] | None
) -> tuple[ResolvedCheckpoint, Storage]:
    """A save root's newest (or ``step``) checkpoint, or the one checkpoint at ``url``; and its storage."""
    from checkpoint_manager.storage import open_storage
    from checkpoint_manager.storage.base import parent_url

    url = url.rstrip("/")
    storage = open_storage(url, storage_options, fsync=False)
    infos, _bad = storage.scan()
    if infos:
        if step is None:
            newest = newest_committed(storage)
            assert newest is not None
            return _from_remote(url, newest, f"newest in {url}"), storage
        match = pick_step(infos, step)  # the current line's when a superseded one has the same step
        if match is not None:
            return _from_remote(url, match, f"step {step} of {url}"), storage
        steps = ", ".join(str(i.step) for i in infos)
        raise CheckpointNotFoundError(f"{url}: no checkpoint at step {step} (steps here: {steps})")
    root = parent_url(url)
    if "://" in root and not root.endswith(":/"):
        parent = open_storage(root, storage_options, fsync=False)
        try:
            info = parent.info_at(url)
        except CheckpointCorruptError as exc:
            if "missing" not in str(exc):
                raise
        else:
            _check_step(url, info.step, step, "one checkpoint")
            return _from_remote(url, info, None), parent
    raise CheckpointNotFoundError(f"{url}: no committed checkpoint here (not a checkpoint or save root)")


def _from_remote(given: str, info: CheckpointInfo, via: str | None) -> ResolvedCheckpoint:
    return ResolvedCheckpoint("remote", info.path, info.step, given, info.meta, via=via, url=info.location)


@contextlib.contextmanager
def local_checkpoint(
    path_or_url: str | Path, *, step: int | None = None, storage_options: dict[str, Any] | None = None
) -> Iterator[ResolvedCheckpoint]:
    """:func:`resolve_checkpoint`, with a URL's checkpoint downloaded for the ``with`` block.

    The copy lives in the storage's cache and is removed on exit; local paths are used in place::

        with local_checkpoint("s3://bucket/run") as ckpt:
            export_hf(ckpt.path, "hf_model")
    """
    from checkpoint_manager.storage import is_url

    if not is_url(str(path_or_url)):
        yield resolve_checkpoint(path_or_url, step=step, storage_options=storage_options)
        return
    resolved, storage = resolve_remote(str(path_or_url), step, storage_options)
    assert resolved.url is not None
    local = storage.localize(resolved.url)
    try:
        yield dataclasses.replace(resolved, path=local)
    finally:
        storage.release_local(local)


def resolve_checkpoint_path(path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The local checkpoint directory ``path`` names, by :func:`checkpoint_manager.formats.resolve.resolve_checkpoint`.

    A checkpoint directory (ours, of any engine; plain ``dcp.save`` output) as is; a bundle → its unpacked
    checkpoint; a save directory → its newest committed checkpoint; nothing there →
    :class:`CheckpointNotFoundError`. URLs: download with :func:`checkpoint_manager.formats.resolve.local_checkpoint`.
    """
    if is_url(str(path)):
        raise ValueError(
            f"{path}: a URL; download it first: `with checkpoint_manager.formats.resolve.local_checkpoint(url) as c: ...(c.path)`"
        )
    p = Path(path)
    if p.is_dir() and ((p / CHECKPOINT_JSON).is_file() or is_plain_dcp(p)):
        return p
    if cache_dir is not None:
        from checkpoint_manager.formats.bundle import is_bundle, open_bundle

        if is_bundle(p):
            return open_bundle(p, cache_dir=cache_dir).checkpoint
    return resolve_checkpoint(p).path
