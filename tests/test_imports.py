"""The package's import structure: no import cycle among its modules, and the layers
import only what they may (core/: neither torch nor Ray; engine/: no Ray; the front ends'
common module: no Ray)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tune_hydra

PACKAGE = "tune_hydra"
ROOT = Path(tune_hydra.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its __init__.py)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: at module level, also inside ``try``,
    ``with`` and ``if`` blocks, but not under ``if TYPE_CHECKING:`` nor in a function or
    class body (a class body runs at import, but no module here imports there)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)
                walk(node.orelse)
                walk(node.finalbody)
            elif isinstance(node, ast.With):
                walk(node.body)

    walk(tree.body)
    return found


def _with_parents(name: str) -> set[str]:
    """``a.b.c`` and the packages importing it runs: ``a``, ``a.b`` (package modules only)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()


def _resolve(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules that ``node``, in ``module``, imports."""
    if isinstance(node, ast.Import):
        return set().union(*(_with_parents(alias.name) for alias in node.names))
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*base_parts, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    out = _with_parents(base)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in MODULES:  # ``from pkg import sub``: the submodule is imported
            out |= _with_parents(sub)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports when it is imported (itself left out)."""
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets: set[str] = set()
        for node in _top_level_imports(tree):
            targets |= _resolve(name, node)
        # A package's own parents are imported first anyway: only edges to other modules.
        graph[name] = targets - _with_parents(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_graph_resolves_submodules_and_parents() -> None:
    graph = import_graph()
    # ``from tune_hydra.frontends.ray import registry`` imports the submodule.
    assert "tune_hydra.frontends.ray.registry" in graph["tune_hydra.frontends.ray.scheduler"]
    # ``from tune_hydra.core.policies import POLICIES`` runs ``tune_hydra.core`` too.
    executor = graph["tune_hydra.frontends.ray.executor"]
    assert {"tune_hydra.core", "tune_hydra.core.policies"} <= executor
    # Imports under ``if TYPE_CHECKING:`` are left out.
    assert "tune_hydra.frontends.ray.executor" not in graph["tune_hydra.frontends.ray.registry"]


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _run(code: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


CORE = sorted(m for m in MODULES if m == "tune_hydra.core" or m.startswith("tune_hydra.core."))


def test_core_imports_neither_torch_nor_ray() -> None:
    assert "tune_hydra.core.policies" in CORE
    _run(
        "import importlib, sys\n"
        f"for name in {CORE!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in ('torch', 'ray') if m in sys.modules)\n"
        "assert not bad, f'importing tune_hydra.core loaded {bad}'\n"
    )


def blocking(package: str) -> str:
    """Code that makes importing ``package`` (or a submodule) fail from then on."""
    return (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {package!r} or name.startswith({package + '.'!r}):\n"
        f"            raise ImportError(f'{package} is blocked in this test ({{name}})')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
    )


BLOCK_RAY = blocking("ray")


def test_engine_works_without_ray() -> None:
    _run(
        BLOCK_RAY + "import tune_hydra.engine\n"
        "import torch\n"
        "from torch import nn\n"
        "import tune_hydra as th\n"
        "data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]\n"
        "task = th.ModelTask(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), nn.MSELoss(),\n"
        "                    lambda p: torch.optim.SGD(p, lr=0.1), data)\n"
        "history = th.train_models({'a': task}, devices='cpu', epochs=2, seed=0)\n"
        "assert len(history['a']) == 2, history\n"
        "assert 'ray' not in sys.modules\n"
    )


@pytest.mark.parametrize(
    "module", ["tune_hydra.frontends.common", "tune_hydra.options", "tune_hydra.core.dispatch"]
)
def test_without_ray_or_torch(module: str) -> None:
    _run(
        f"import sys, {module}\n"
        "bad = sorted(m for m in ('torch', 'ray') if m in sys.modules)\n"
        f"assert not bad, f'importing {module} loaded {{bad}}'\n"
    )


def test_peft_is_optional_and_never_imported() -> None:
    """peft is the ``lora`` extra: importing the package (its model adapters included)
    never loads it, and models are told apart without it."""
    _run(
        blocking("peft")
        + "import tune_hydra, tune_hydra.engine, tune_hydra.models, tune_hydra.models.peft\n"
        "from torch import nn\n"
        "from tune_hydra.engine.task import model_layers\n"
        "assert not tune_hydra.models.is_peft_model(nn.Linear(2, 2))\n"
        "assert len(model_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))) == 2\n"
        "assert 'peft' not in sys.modules\n"
    )
