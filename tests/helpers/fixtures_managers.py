"""A zoo of manager classes, good and bad, that the factory tests import by dotted path.

It is a real module (not defined inside a test) so ``importlib`` finds the classes the same way it
finds a user's ``my_pkg.managers.MyManager``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from checkpoint_manager import CheckpointConfig, LoadContext, LoadResult, SaveContext, SaveResult


class _Base:
    """Shared do-nothing behaviour: the factory tests only care about classes and configs."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config

    def should_load(self, ctx: LoadContext) -> bool:
        return False

    def load(self, ctx: LoadContext) -> LoadResult:
        return LoadResult(path="", step=0)

    def save(self, ctx: SaveContext) -> SaveResult | None:
        return None

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        return None


class Good(_Base):
    """The plainest valid manager."""


class BucketConfig(CheckpointConfig):
    bucket: str
    retries: int = 3


class OtherConfig(CheckpointConfig):
    colour: str = "red"


class WithConfig(_Base):
    """Declares its own config class, so the factory validates into it."""

    config_class: ClassVar[type[CheckpointConfig]] = BucketConfig


class QuietConfig(CheckpointConfig):
    """Changes a base default, which a re-validated base config must not override."""

    fsync: bool = False
    note: str = "none"


class WithQuietConfig(_Base):
    config_class: ClassVar[type[CheckpointConfig]] = QuietConfig


class VarArgs:
    """``*args`` / ``**kwargs`` accept every call, so the factory must accept them too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def should_load(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def load(self, *args: Any, **kwargs: Any) -> LoadResult:
        return LoadResult(path="", step=0)

    def save(self, *args: Any, **kwargs: Any) -> SaveResult | None:
        return None

    def finalize_async_saves(self, **kwargs: Any) -> None:
        return None


class StaticSave(_Base):
    """A staticmethod taking just ``ctx`` is called correctly through an instance."""

    @staticmethod
    def save(ctx: SaveContext) -> SaveResult | None:
        return None


class ExtraOptional(_Base):
    """Extra parameters with defaults are fine."""

    def load(self, ctx: LoadContext, verbose: bool = False) -> LoadResult:
        return LoadResult(path="", step=0)

    def finalize_async_saves(
        self, *, blocking: bool = False, terminate: bool = False, timeout: float | None = None
    ) -> None:
        return None


# ---- bad ones ---------------------------------------------------------------------------------


class MissingSave:
    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config

    def should_load(self, ctx: LoadContext) -> bool:
        return False

    def load(self, ctx: LoadContext) -> LoadResult:
        return LoadResult(path="", step=0)

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        return None


class MissingTwo:
    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config

    def should_load(self, ctx: LoadContext) -> bool:
        return False

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        return None


class Empty:
    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config


class SaveNoCtx(_Base):
    def save(self) -> SaveResult | None:  # type: ignore[override]
        return None


class LoadExtraRequired(_Base):
    def load(self, ctx: LoadContext, other_required: int) -> LoadResult:  # type: ignore[override]
        return LoadResult(path="", step=0)


class FinalizeNoKeywords(_Base):
    def finalize_async_saves(self) -> None:  # type: ignore[override]
        return None


class FinalizePositionalOnly(_Base):
    def finalize_async_saves(self, blocking: bool, terminate: bool, /) -> None:  # type: ignore[override]
        return None


class StaticSaveWithSelf(_Base):
    @staticmethod
    def save(self: Any, ctx: SaveContext) -> SaveResult | None:  # type: ignore[override]
        return None


class ClassmethodNoCtx(_Base):
    @classmethod
    def should_load(cls) -> bool:  # type: ignore[override]
        return False


class SaveIsInt(_Base):
    save = 3  # type: ignore[assignment]


class SaveIsProperty(_Base):
    @property
    def save(self) -> Any:  # type: ignore[override]
        return None


class NoConfigInit(_Base):
    def __init__(self) -> None:  # type: ignore[override]
        super().__init__(CheckpointConfig(save_dir="unused"))


class InitTwoRequired(_Base):
    def __init__(self, config: CheckpointConfig, client: Any) -> None:
        super().__init__(config)


class NoInitAtAll:
    def should_load(self, ctx: LoadContext) -> bool:
        return False

    def load(self, ctx: LoadContext) -> LoadResult:
        return LoadResult(path="", step=0)

    def save(self, ctx: SaveContext) -> SaveResult | None:
        return None

    def finalize_async_saves(self, *, blocking: bool = False, terminate: bool = False) -> None:
        return None


class BadConfigClass(_Base):
    config_class = dict  # type: ignore[assignment]


class ManyProblems:
    """Missing methods, a bad signature and a bad constructor at once: all must be named."""

    def __init__(self) -> None:
        pass

    def save(self) -> None:
        return None


class Outer:
    class Inner(_Base):
        """Reachable only with the colon form ``mod:Outer.Inner``."""


def not_a_class(config: CheckpointConfig) -> Good:
    return Good(config)


AN_INT = 42


class NoAsync(_Base):
    """Declares the core fields it does not implement, so setting them warns."""

    unsupported_config_fields: ClassVar[frozenset[str]] = frozenset({"async_save", "keep_best"})


class BadUnsupported(_Base):
    unsupported_config_fields: ClassVar[tuple[str, ...]] = ("keep_lats",)
