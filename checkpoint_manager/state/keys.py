"""The key schema of a checkpoint's training state, spelled once.

Every tensor and value of a save lives under a part: ``model`` (``model_0``, ``model_1``, ... for
several models), ``optim`` (``optim_1``, ... for more optimizers), ``scheduler`` (likewise),
``extra.<name>``, ``train_state``; ``rng`` and ``dataloader`` are saved per rank. The state
gatherer, the loaders, the formats and the exports name parts through this module.
"""

from __future__ import annotations

__all__ = [
    "DATALOADER",
    "EXTRA",
    "MODEL",
    "OPTIM",
    "PER_RANK_PARTS",
    "RNG",
    "SCHEDULER",
    "TRAIN_STATE",
    "extra_key",
    "is_model_key",
    "model_keys",
    "numbered",
]

MODEL = "model"
OPTIM = "optim"
SCHEDULER = "scheduler"
EXTRA = "extra"
TRAIN_STATE = "train_state"
RNG = "rng"
DATALOADER = "dataloader"
#: What is saved per rank (``rank_XXXXX.json``), as opposed to global state that DCP reshards.
PER_RANK_PARTS = (RNG, DATALOADER)


def model_keys(n: int) -> list[str]:
    """The parts of ``n`` models: ``["model"]`` for one, ``["model_0", "model_1", ...]`` for several."""
    return [MODEL] if n == 1 else [f"{MODEL}_{i}" for i in range(n)]


def is_model_key(part: str) -> bool:
    """Whether ``part`` (a key's first component) is a model's: ``model`` or ``model_<i>``."""
    return part == MODEL or (part.startswith(f"{MODEL}_") and part[len(MODEL) + 1 :].isdigit())


def numbered(part: str, i: int) -> str:
    """The ``i``-th optimizer's or scheduler's part: ``optim``, ``optim_1``, ``optim_2`` ..."""
    return part if i == 0 else f"{part}_{i}"


def extra_key(name: str) -> str:
    """The part of ``extra[name]``."""
    return f"{EXTRA}.{name}"
