"""Conformance suites: run them against your own manager or engine to know it keeps the contract.

* :mod:`checkpoint_manager.testing.managers`: a :class:`~checkpoint_manager.CheckpointManager`
  (``run_conformance_check`` / ``run_conformance_suite``, the checks in ``CONFORMANCE_CHECKS``);
* :mod:`checkpoint_manager.testing.engines`: an :class:`~checkpoint_manager.engine.base.Engine` on its
  own (``run_engine_check`` / ``run_engine_suite``, ``ENGINE_CHECKS``) and inside the default
  manager's lifecycle (``run_lifecycle_check`` / ``run_lifecycle_suite``, ``LIFECYCLE_CHECKS``).

A failed check raises :class:`ConformanceError` (an ``AssertionError``) whose ``check`` names it and
whose message says what broke.
"""

from __future__ import annotations

from checkpoint_manager.testing._common import ConformanceError
from checkpoint_manager.testing.engines import (
    ENGINE_CHECKS,
    LIFECYCLE_CHECKS,
    OPTIONAL_ENGINE_CHECKS,
    MakeEngine,
    run_engine_check,
    run_engine_suite,
    run_lifecycle_check,
    run_lifecycle_suite,
)
from checkpoint_manager.testing.managers import (
    CONFORMANCE_CHECKS,
    MakeManager,
    manager_maker,
    run_conformance_check,
    run_conformance_suite,
)

__all__ = [
    "CONFORMANCE_CHECKS",
    "ENGINE_CHECKS",
    "LIFECYCLE_CHECKS",
    "OPTIONAL_ENGINE_CHECKS",
    "ConformanceError",
    "MakeEngine",
    "MakeManager",
    "manager_maker",
    "run_conformance_check",
    "run_conformance_suite",
    "run_engine_check",
    "run_engine_suite",
    "run_lifecycle_check",
    "run_lifecycle_suite",
]
