"""The package's shape: no import cycle, imports run down the layers, no class over 400 lines.

Every import counts, function-local ones too (a lazy import is still a dependency); those under
``if TYPE_CHECKING:``, which never run, count for the cycles (a type-only cycle is still two
modules that cannot be read apart) but not for the layers.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from tests.helpers.process import ROOT

PACKAGE = ROOT / "checkpoint_manager"

#: low -> high; a module may import its own layer and the layers below it
LAYERS: dict[str, int] = {
    "errors": 0,
    "_version": 0,
    "core": 0,
    "storage": 1,
    "state": 2,
    "protocol": 2,  # the contexts and results state/ and everything above use
    "engine": 3,
    "formats": 4,
    "config": 5,  # validated with formats' size parser; read by the lifecycle
    "config_fields": 5,
    "lifecycle": 6,
    "factory": 7,  # builds the lifecycle's manager from a config
    "cli": 8,
    "integrations": 8,
    "testing": 9,
    "__init__": 10,
    "__main__": 10,
}
#: the one import allowed to run upward (empty: none)
ALLOWED_UPWARD: set[tuple[str, str]] = set()
MAX_CLASS_LINES = 400


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = file
    return out


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement but those only type checkers see."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        visit(node)

    visit(tree)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, those only type checkers see included."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def _graph(*, type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports (``type_only``: those under ``TYPE_CHECKING`` too)."""
    modules = _modules()
    imports = _all_imports if type_only else _runtime_imports

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, file in modules.items():
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in imports(ast.parse(file.read_text(), str(file))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:  # ``from pkg import submodule`` depends on the submodule
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else known(base))
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    key = "__init__" if len(parts) == 1 else parts[1]
    assert key in LAYERS, f"{module}: in no layer (add its package to LAYERS in {__file__})"
    return LAYERS[key]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_sees_function_local_imports_but_not_type_checking_ones() -> None:
    graph = _graph()
    # resolve's import of the bundle reader is function-local
    assert "checkpoint_manager.formats.bundle" in graph["checkpoint_manager.formats.resolve"]
    # retention names CheckpointConfig for the type checker only
    assert "checkpoint_manager.config" not in graph["checkpoint_manager.lifecycle.retention"]


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_no_import_cycle_even_among_type_only_imports() -> None:
    """Parts that name each other's types for the checker are still tangled: none."""
    assert _cycles(_graph(type_only=True)) == []


def test_the_type_only_graph_sees_type_checking_imports() -> None:
    assert "checkpoint_manager.config" in _graph(type_only=True)["checkpoint_manager.lifecycle.retention"]


def test_imports_run_down_the_layers() -> None:
    graph = _graph()
    upward = sorted(
        (module, target) for module, targets in graph.items() for target in targets if _layer(target) > _layer(module)
    )
    assert len(upward) <= 1 and set(upward) <= ALLOWED_UPWARD, upward


def _class_sizes() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, file in _modules().items():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                sizes[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def test_no_class_over_400_lines() -> None:
    large = {name: n for name, n in _class_sizes().items() if n > MAX_CLASS_LINES}
    assert large == {}


# -- DCP's files are the DCP engine's business --------------------------------------------------------
DCP_ENGINE = "checkpoint_manager.engine.dcp"
#: DCP's own readers, writers and index types, which only the DCP engine drives
DCP_INTERNALS = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.state_dict_loader",
    "torch.distributed.checkpoint.state_dict_saver",
    "torch.distributed.checkpoint.planner",
)
#: below the engine, the save and verify path still names DCP's index file (not reading it)
DCP_NAMES_BELOW_THE_ENGINE = {
    "checkpoint_manager.core.layout": "defines METADATA_FILE beside the other file names",
    "checkpoint_manager.core.integrity": "verify CRC-checks the files a load reads whole; a load-deletion marker",
    "checkpoint_manager.storage.remote": "rank 0 uploads DCP's index with its files; the sweep knows our file names",
}
#: the one place that names the built-in engine by its dotted path (imported on demand)
DCP_REGISTRATION = "checkpoint_manager.core.plugins"


def _dcp_mentions(tree: ast.Module) -> list[str]:
    """Imports of DCP's internals or our DCP engine, and code (not docstrings) naming ``.metadata``."""
    docstrings = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found: list[str] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        found += [f"imports {n}" for n in names if n.startswith((DCP_ENGINE, *DCP_INTERNALS))]
        if isinstance(node, ast.Name) and node.id == "METADATA_FILE":
            found.append(f"line {node.lineno}: METADATA_FILE")
        if isinstance(node, ast.alias) and node.name == "METADATA_FILE":
            found.append("imports METADATA_FILE")
        text = node.value if isinstance(node, ast.Constant) and id(node) not in docstrings else None
        if isinstance(text, str) and (".metadata" in text or DCP_ENGINE in text):
            found.append(f"line {node.lineno}: {text!r}")
    return sorted(set(found))


def test_nothing_outside_the_dcp_engine_imports_it_or_reads_its_index() -> None:
    """formats/, cli/, lifecycle/, testing/ and the rest of engine/ read checkpoints through the
    engine that wrote them; only ``engine/dcp/`` knows DCP's files."""
    graph = _graph()
    importers = sorted(
        (module, target)
        for module, targets in graph.items()
        if not module.startswith(DCP_ENGINE)
        for target in targets
        if target.startswith(DCP_ENGINE)
    )
    assert importers == []
    offenders: dict[str, list[str]] = {}
    for name, file in _modules().items():
        if name.startswith(DCP_ENGINE) or name in DCP_NAMES_BELOW_THE_ENGINE:
            continue
        found = _dcp_mentions(ast.parse(file.read_text(), str(file)))
        if name == DCP_REGISTRATION:
            found = [f for f in found if f != f"line {_registration_line(file)}: '{DCP_ENGINE}.engine:DCPEngine'"]
        if found:
            offenders[name] = found
    assert offenders == {}


def _registration_line(file: Path) -> int:
    return next(i for i, line in enumerate(file.read_text().splitlines(), 1) if f'"{DCP_ENGINE}.engine:DCPEngine"' in line)


def test_the_dcp_check_sees_what_it_looks_for() -> None:
    """The check above would catch each kind of mention (so its silence means something)."""
    source = (
        '"""Reads .metadata (a docstring: fine)."""\n'
        "from checkpoint_manager.engine.dcp.io import read_dcp_metadata\n"
        "import torch.distributed.checkpoint.metadata\n"
        "from checkpoint_manager.core.layout import METADATA_FILE\n"
        "x = path / '.metadata'\n"
        "y = METADATA_FILE\n"
    )
    assert _dcp_mentions(ast.parse(source)) == [
        "imports METADATA_FILE",
        "imports checkpoint_manager.engine.dcp.io",
        "imports checkpoint_manager.engine.dcp.io.read_dcp_metadata",
        "imports torch.distributed.checkpoint.metadata",
        "line 5: '.metadata'",
        "line 6: METADATA_FILE",
    ]


# -- the plugin API: what a plugin may import ----------------------------------------------------------
PLUGINS = ROOT / "plugins"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _plugin_api_modules() -> set[str]:
    """The modules ``docs/architecture.md``'s seams section names as the plugin API (besides
    ``checkpoint_manager`` itself, whose ``__all__`` is public)."""
    seams = ARCHITECTURE.read_text().split("## The seams", 1)[1]
    named = set(re.findall(r"`(checkpoint_manager(?:\.[a-z_]+)+)`", seams))
    return {name for name in named if name in _modules()}


def _plugin_imports(source: str) -> list[tuple[str, str | None]]:
    """``(module, name)`` of every import of ``checkpoint_manager`` in ``source`` (name None: the module)."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "checkpoint_manager"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "checkpoint_manager":
            found += [(str(node.module), alias.name) for alias in node.names]
    return found


def _outside_the_plugin_api(source: str, api: set[str]) -> list[str]:
    import checkpoint_manager

    bad: list[str] = []
    for module, name in _plugin_imports(source):
        if module == "checkpoint_manager":
            if name is not None and name not in checkpoint_manager.__all__:
                bad.append(f"checkpoint_manager.{name}")
        elif module not in api:
            bad.append(module if name is None else f"{module}.{name}")
        elif name is not None and name not in importlib.import_module(module).__all__:
            bad.append(f"{module}.{name}")
    return bad


def test_plugins_import_only_the_plugin_api() -> None:
    api = _plugin_api_modules()
    assert {"checkpoint_manager.engine.base", "checkpoint_manager.engine.dcp", "checkpoint_manager.errors",
            "checkpoint_manager.testing"} <= api
    sources = sorted(PLUGINS.glob("*/src/*/*.py"))
    assert {p.parts[-4] for p in sources} >= {
        "checkpoint-manager-safetensors", "checkpoint-manager-tiered", "checkpoint-manager-torch-checkpointing",
        "checkpoint-manager-torchtitan",
    }
    offenders = {
        str(p.relative_to(PLUGINS)): bad for p in sources if (bad := _outside_the_plugin_api(p.read_text(), api))
    }
    assert offenders == {}


def test_the_plugin_api_check_sees_what_it_looks_for() -> None:
    api = {"checkpoint_manager.engine.dcp"}
    source = (
        "import checkpoint_manager\n"
        "from checkpoint_manager import DefaultCheckpointManager, ManagerCore\n"
        "from checkpoint_manager.core.dist import DistContext\n"
        "import checkpoint_manager.lifecycle.saving\n"
        "from checkpoint_manager.engine.dcp import read_dcp_metadata, _RestrictedUnpickler\n"
        "def f():\n    from checkpoint_manager.protocol import FinalizeOnExit\n"
    )
    assert _outside_the_plugin_api(source, api) == [
        "checkpoint_manager.ManagerCore",
        "checkpoint_manager.core.dist.DistContext",
        "checkpoint_manager.lifecycle.saving",
        "checkpoint_manager.engine.dcp._RestrictedUnpickler",
        "checkpoint_manager.protocol.FinalizeOnExit",
    ]


# -- the lifecycle: a facade over collaborators ---------------------------------------------------------
MAX_FACADE_LINES = 250


def test_the_default_manager_is_a_facade_without_mixins() -> None:
    """``DefaultCheckpointManager`` delegates: at most 250 lines, and no base class but the
    finalize-on-exit protocol (no mixins, no core of shared fields)."""
    from checkpoint_manager.lifecycle.manager import DefaultCheckpointManager
    from checkpoint_manager.protocol import FinalizeOnExit

    size = _class_sizes()["checkpoint_manager.lifecycle.manager.DefaultCheckpointManager"]
    assert size <= MAX_FACADE_LINES, size
    assert DefaultCheckpointManager.__bases__ == (FinalizeOnExit,)
    assert not (PACKAGE / "lifecycle" / "core.py").exists()


def _builds_checkpoint_json(tree: ast.Module) -> bool:
    """A dict display with the keys only a ``checkpoint.json`` record has (its format's, the
    library's and torch's versions; a bundle's manifest has no torch version)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if {"format_version", "library_version", "torch_version"} <= keys:
                return True
    return False


def test_checkpoint_json_is_built_in_one_place() -> None:
    builders = sorted(name for name, p in _modules().items() if _builds_checkpoint_json(ast.parse(p.read_text())))
    assert builders == ["checkpoint_manager.core.layout"]


def _writes_pointers(tree: ast.Module) -> bool:
    """Calls that write or remove a ``latest``/``best`` pointer (or their symlinks)."""
    return any(
        isinstance(node, ast.Attribute) and node.attr in ("write_pointer", "remove_pointer", "link_pointers")
        for node in ast.walk(tree)
    )


def test_pointers_move_in_one_place() -> None:
    """In the lifecycle only ``Pointers`` moves ``latest`` and ``best`` (retention only deletes)."""
    movers = sorted(
        name
        for name, p in _modules().items()
        if name.startswith("checkpoint_manager.lifecycle.") and _writes_pointers(ast.parse(p.read_text()))
    )
    assert movers == ["checkpoint_manager.lifecycle.pointers"]


# -- docs/architecture.md names the function of each step -------------------------------------------------
#: "(`Name.attr`, `pkg/module.py`" or "`name` of `pkg/module.py`": a function and where it lives
_NAMED_AT = re.compile(r"`([A-Za-z_][\w.]*)`(?:, | of )`([\w/]+)\.py`")


def _steps(section: str) -> list[str]:
    body = ARCHITECTURE.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.split(r"\n(?=\d+\. \*\*)", body)[1:]


def _named_functions(step: str) -> list[tuple[str, str]]:
    return [(name, "checkpoint_manager." + path.replace("/", ".")) for name, path in _NAMED_AT.findall(step)]


def _resolves(name: str, module: str) -> bool:
    obj: object = importlib.import_module(module)
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return callable(obj)


def test_each_step_of_a_save_and_a_load_names_the_function_that_does_it() -> None:
    for section in ("A save, step by step", "A load, step by step"):
        steps = _steps(section)
        assert len(steps) >= 6, section
        for number, step in enumerate(steps, start=1):
            lead = re.match(r"\d+\. \*\*.+?\*\* \(`[A-Za-z_][\w.]*`, `[\w/]+\.py`", step, re.S)
            assert lead is not None, f"{section}, step {number} names no function first: {step[:120]!r}"
            missing = [f"{m}.{n}" for n, m in _named_functions(step) if not _resolves(n, m)]
            assert missing == [], f"{section}, step {number}"


def test_the_step_name_check_sees_what_it_looks_for() -> None:
    step = "1. **Writes** (`Writer.write`, `lifecycle/write.py`, with `nothing_here` of `core/layout.py`)"
    named = _named_functions(step)
    assert named == [
        ("Writer.write", "checkpoint_manager.lifecycle.write"),
        ("nothing_here", "checkpoint_manager.core.layout"),
    ]
    assert [_resolves(n, m) for n, m in named] == [True, False]
