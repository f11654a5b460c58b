"""A zoo of engine classes, good and bad, that the engine factory tests import by dotted path.

A real module (not classes defined inside a test) so ``importlib`` finds them the way it finds a
user's ``my_pkg.engines.MyEngine``. ``Good`` is a working engine: one safetensors file per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoint_manager import CheckpointConfig
from checkpoint_manager.engine.base import EngineContext, EngineState, FileRecord, TensorInfo
from tests.helpers import fixtures_managers


class Good:
    """The plainest valid engine, and a real one: every tensor of a rank in one safetensors file."""

    name: ClassVar[str] = "zoo-safetensors"

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config

    def save(self, state: EngineState, directory: Path, ctx: EngineContext) -> Mapping[str, FileRecord] | None:
        tensors = {key: t.detach().contiguous() for key, t in state.tensors.items()}
        save_file(tensors, str(directory / f"tensors_{ctx.rank}.safetensors"))
        return None

    def read_index(self, directory: Path, ctx: EngineContext) -> Mapping[str, TensorInfo]:
        with safe_open(str(directory / f"tensors_{ctx.rank}.safetensors"), framework="pt") as f:
            return {key: TensorInfo(tuple(f.get_slice(key).get_shape()), f.get_tensor(key).dtype) for key in f.keys()}  # noqa: SIM118

    def load(self, targets: Mapping[str, torch.Tensor], directory: Path, ctx: EngineContext) -> None:
        with safe_open(str(directory / f"tensors_{ctx.rank}.safetensors"), framework="pt") as f:
            for key, target in targets.items():
                target.copy_(f.get_tensor(key))


class Staging(Good):
    """Optional methods with the right signatures, one of them a keyword-friendly variant."""

    def stage(self, state: EngineState, ctx: EngineContext) -> EngineState:
        return EngineState({key: t.clone() for key, t in state.tensors.items()}, dict(state.objects))

    def warm_up(self, state: EngineState, ctx: EngineContext, budget: float = 1.0) -> None:
        return None


class Flexible:
    """Signatures looser than the protocol's still accept its calls."""

    name = "flexible"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def save(self, *args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def read_index(directory: Path, ctx: EngineContext, verbose: bool = False) -> dict[str, TensorInfo]:
        return {}

    @classmethod
    def load(cls, targets: Any, directory: Path, ctx: EngineContext) -> None:
        return None


class Outer:
    class Inner(Good):
        """Reached only by the colon form ``module:Outer.Inner``."""


class CompressConfig(CheckpointConfig):
    """An engine's own fields, validated like the core ones."""

    compression: Literal["none", "zstd"] = "none"
    level: int = Field(default=3, ge=1, le=22)

    @field_validator("level")
    @classmethod
    def _odd_levels_only(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"level must be odd, got {value}")
        return value


class WithConfig(Good):
    name = "zoo-compress"
    config_class: ClassVar[type[CheckpointConfig]] = CompressConfig


class BucketCompressConfig(fixtures_managers.BucketConfig):
    """Extends the ``WithConfig`` manager's config, so one config serves the manager and this engine."""

    compression: Literal["none", "zstd"] = "none"


class WithBucketConfig(Good):
    config_class: ClassVar[type[CheckpointConfig]] = BucketCompressConfig


# ---- broken engines --------------------------------------------------------------------------


class MissingName(Good):
    name = None  # type: ignore[assignment]


class NoNameAtAll:
    def __init__(self, config: CheckpointConfig) -> None:
        pass

    save = Good.save
    read_index = Good.read_index
    load = Good.load


class EmptyName(Good):
    name = "  "


class MissingLoad:
    name = "x"

    def __init__(self, config: CheckpointConfig) -> None:
        pass

    save = Good.save
    read_index = Good.read_index


class MissingTwo:
    name = "x"

    def __init__(self, config: CheckpointConfig) -> None:
        pass

    save = Good.save


class SaveTwoArgs(Good):
    def save(self, state: EngineState, directory: Path) -> None:  # type: ignore[override]
        return None


class SaveKeywordOnlyCtx(Good):
    def save(self, state: EngineState, directory: Path, *, ctx: EngineContext) -> None:  # type: ignore[override]
        return None


class ReadIndexExtraRequired(Good):
    def read_index(self, directory: Path, ctx: EngineContext, strict: bool) -> dict[str, TensorInfo]:  # type: ignore[override]
        return {}


class StaticLoadWithSelf(Good):
    @staticmethod
    def load(self: Any, targets: Any, directory: Path, ctx: EngineContext) -> None:  # type: ignore[override]
        return None


class LoadIsProperty(Good):
    @property
    def load(self) -> Any:  # type: ignore[override]
        return None


class StageOneArg(Good):
    def stage(self, state: EngineState) -> EngineState:
        return state


class WarmUpIsInt(Good):
    warm_up = 3


class NoConfigInit(Good):
    def __init__(self) -> None:  # type: ignore[override]
        pass


class BadConfigClass(Good):
    config_class = dict


class ManyProblems:
    name = ""

    def __init__(self) -> None:
        pass

    def save(self) -> None:
        return None

    def stage(self, state: EngineState, ctx: EngineContext, extra: int) -> EngineState:
        return state


def not_a_class(config: CheckpointConfig) -> Good:
    return Good(config)
