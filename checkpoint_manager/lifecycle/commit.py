"""The commit, rank 0's part of the collective once every rank's part is written: the JSON state and
the models' configs, the consolidated export, ``checkpoint.json`` written last, one rename into
place (an object store: the marker last), then the ``latest`` pointer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from checkpoint_manager.core.layout import (
    CHECKPOINT_JSON,
    LATEST_POINTER,
    STATE_JSON,
    info_from_meta,
    seal_checkpoint_json,
)
from checkpoint_manager.errors import PostCommitError
from checkpoint_manager.formats.model_config import HFConfigRecorder
from checkpoint_manager.lifecycle.cursor import Cursor
from checkpoint_manager.lifecycle.describe import Describer
from checkpoint_manager.lifecycle.exports import ConsolidatedExport
from checkpoint_manager.lifecycle.job import SaveJob
from checkpoint_manager.lifecycle.pointers import Pointers
from checkpoint_manager.storage import Storage, basename

__all__ = ["Committer"]


class Committer:
    """Publishes a fully written save of save_dir (rank 0)."""

    def __init__(
        self,
        storage: Storage,
        *,
        hf_configs: HFConfigRecorder,
        export: ConsolidatedExport,
        describer: Describer,
        pointers: Pointers,
        cursor: Cursor,
    ) -> None:
        self.storage = storage
        self.hf_configs = hf_configs
        self.export = export
        self.describer = describer
        self.pointers = pointers
        self.cursor = cursor

    def commit(self, job: SaveJob, votes: list[Any]) -> str:
        """Rank 0, once every rank voted its part written: describe the pending directory in
        checkpoint.json (the file records the ranks ``votes`` carry), rename it into place, move
        ``latest``; the committed location. A failure after the rename is a :class:`PostCommitError`."""
        storage, pending = self.storage, job.pending
        storage.write_json(pending / STATE_JSON, job.state.global_json)
        self.hf_configs.write(pending, job.hf_configs, storage.write_json)
        engine_record = self.describer.engine_record()
        # inside: committed with the rest; read by the engine that wrote it, as checkpoint.json will say
        self.export.run(job, self.describer.header(job, engine_record))
        t_json = time.perf_counter()
        meta, lineage = self.describer.describe(job, engine_record, votes)
        storage.write_json(pending / CHECKPOINT_JSON, seal_checkpoint_json(meta))  # sealed as written
        job.timings["checkpoint_json"] = time.perf_counter() - t_json
        t_rename = time.perf_counter()
        final = storage.commit(pending, job.name)  # object stores: the marker is written last
        job.timings["rename"] = time.perf_counter() - t_rename
        final_name = basename(final)
        try:
            self.pointers.committed(final_name, job.step, lineage)
        except Exception as exc:  # committed already: say so, rather than "the save failed"
            raise PostCommitError(str(final), f"moving the {LATEST_POINTER!r} pointer", exc) from exc
        self.cursor.descend_from(info_from_meta(Path(final_name), meta))
        return str(final)
