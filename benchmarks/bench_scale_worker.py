"""One rank of a real gloo job for ``bench_scale --anchor``: a tiny Llama-shaped model under FSDP2
with AdamW, saved twice (the second save reuses the first's plan) and loaded once by the manager;
each rank writes the save and load records (per-phase seconds) to ``records_<rank>.json``.

    RANK=r WORLD_SIZE=n python -m benchmarks.bench_scale_worker JOB_DIR
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from checkpoint_manager import (
    CheckpointConfig,
    DefaultCheckpointManager,
    LoadContext,
    SaveContext,
    TrainState,
)

warnings.filterwarnings("ignore")


class Norm(nn.Module):
    """A norm's one weight, named as Llama's (``...layernorm.weight``)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


class Block(nn.Module):
    def __init__(self, hidden: int, inter: int, kv: int) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.self_attn.k_proj = nn.Linear(hidden, kv, bias=False)
        self.self_attn.v_proj = nn.Linear(hidden, kv, bias=False)
        self.self_attn.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        self.input_layernorm = Norm(hidden)
        self.post_attention_layernorm = Norm(hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        x = h * self.input_layernorm.weight
        h = h + a.o_proj(a.q_proj(x) + a.v_proj(x).repeat(1, 1, a.q_proj.out_features // a.v_proj.out_features))
        x = h * self.post_attention_layernorm.weight
        m = self.mlp
        return h + m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))  # type: ignore[no-any-return]


class TinyLlama(nn.Module):
    """The parameter names and structure of a Llama model, at width 64 and 2 layers."""

    def __init__(self, layers: int = 2, hidden: int = 64, inter: int = 128, kv: int = 32, vocab: int = 256) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(Block(hidden, inter, kv) for _ in range(layers))
        self.model.norm = Norm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(h * self.model.norm.weight)  # type: ignore[no-any-return]


def main(job: Path) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{job / 'store'}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    torch.manual_seed(0)
    model = TinyLlama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    records: dict[str, list[dict[str, float]]] = {"saves": [], "loads": []}
    config = CheckpointConfig(save_dir=str(job / "ckpt"), fsync=True)
    with DefaultCheckpointManager(config) as manager:
        for _ in range(3):
            loss = model(ids).float().pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            result = manager.save(SaveContext(model=model, optimizer=optimizer, train_state=state, force=True))
            assert result is not None
            records["saves"].append(dict(result.timings))
    with DefaultCheckpointManager(config) as manager:
        loaded = manager.load(LoadContext(model=model, optimizer=optimizer, train_state=TrainState()))
        records["loads"].append(dict(loaded.timings))
    (job / f"records_{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
