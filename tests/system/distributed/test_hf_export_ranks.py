"""A checkpoint written by two FSDP2 ranks exports to Hugging Face (loads with equal logits), and
Hugging Face weights load into a model sharded over two ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from checkpoint_manager import CheckpointConfig, DefaultCheckpointManager, SaveContext, TrainState
from checkpoint_manager.core.integrity import verify
from checkpoint_manager.formats import export_hf, load_hf_weights
from tests.unit.formats.test_formats_hf import artifacts, file_tensors, logits, tiny_llama  # noqa: F401 (fixture)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sharded_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_llama()
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}/reference.pt")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        state = TrainState()
        state.step = 5
        with DefaultCheckpointManager(CheckpointConfig(save_dir=f"{out}/ckpt", fsync=False)) as mgr:
            mgr.save(SaveContext(model=model, train_state=state, force=True))
        # initial weights from a Hugging Face directory into a sharded model
        fresh = tiny_llama(seed=3)
        for layer in fresh.model.layers:
            fully_shard(layer)
        fully_shard(fresh)
        load_hf_weights(fresh, f"{out}/community")
        full = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({k: v.clone() for k, v in full.items()}, f"{out}/loaded.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_sharded_over_two_ranks_export_and_initial_load(tmp_path: Path, artifacts: Path) -> None:  # noqa: F811
    import torch.multiprocessing as mp

    community = tiny_llama(seed=1)
    community.save_pretrained(tmp_path / "community")
    # forkserver: both ranks fork from one fresh server (one import of transformers, not two), and
    # not from this process, whose earlier tests leave state (threads, I/O buffers) behind
    mp.start_processes(_sharded_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="forkserver")
    ckpt = tmp_path / "ckpt" / "step_00000005"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert verify(ckpt, "full") == []  # every file's CRC32 as recorded
    export_hf(ckpt, tmp_path / "hf", artifacts_dir=artifacts, max_shard_size="20KB", buffer_size="8KB")
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    tensors = file_tensors(tmp_path / "hf")
    assert set(tensors) == set(reference) - {"lm_head.weight"}
    for key, tensor in tensors.items():
        assert torch.equal(tensor, reference[key]), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(logits(loaded), logits(tiny_llama()))
    # and the sharded model that took its initial weights from the Hugging Face directory
    got = torch.load(tmp_path / "loaded.pt", weights_only=True)
    want = community.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
