"""The layout holds: the Lightning-free layers load no Lightning, no import cycles, short files, layers import downward,
benchmark/ never imports the CLI.

The static checks read the package's source with :mod:`ast` (docstrings and comments do not count; imports inside
functions and under ``TYPE_CHECKING`` do) so they see every import, not only those a test happens to execute.
"""

from __future__ import annotations

import ast
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import lightning_perf
from tests._probes import Probes

PACKAGE = "lightning_perf"
ROOT = Path(lightning_perf.__file__).resolve().parent
MAX_LINES = 800
LIGHTNING = ("lightning", "pytorch_lightning")

# Layers, lowest first (see docs/architecture.md). A module may import its own layer and lower ones only.
NO_LIGHTNING_LAYERS = ("profiling", "functional", "deploy")
HIGHER_LAYERS = ("callbacks", "strategies", "demos", "benchmark", "tuning", "cli")
FORBIDDEN_WITHIN_LOW = {
    "profiling": ("functional", "deploy"),
    "functional": ("deploy",),
    "deploy": (),
    "": (),  # root private utilities
}


# ------------------------------------------------------------------------------------------------ source reading


@dataclass(frozen=True)
class Import:
    """One import statement's target, as an absolute dotted name, and where it is."""

    target: str
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_files() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _source_files()
TREES = {module: ast.parse(path.read_text(), filename=str(path)) for module, path in MODULES.items()}


def _imports_of(module: str, path: Path, tree: ast.AST | None = None) -> list[Import]:
    """Every import in the file, at module level or inside functions and classes, with relative ones resolved.

    ``from pkg import name`` where ``pkg.name`` is a module of this package counts as importing that module;
    ``importlib.import_module("literal")`` counts too.
    """
    if tree is None:
        tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found: list[Import] = []

    for node in ast.walk(tree):  # under `if TYPE_CHECKING:` too: a circle through type hints is still a circle
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append(Import(submodule if submodule in MODULES else source, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(node.args[0].value, node.lineno))
    return found


def _resolve(target: str) -> str | None:
    """The module of this package that importing ``target`` runs (its longest known prefix), else ``None``."""
    if target != PACKAGE and not target.startswith(PACKAGE + "."):
        return None
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in MODULES:
            return name
        parts.pop()
    return None


IMPORTS = {module: _imports_of(module, path, TREES[module]) for module, path in MODULES.items()}


def _layer(module: str) -> str | None:
    """``"profiling"``, ``"functional"``, ``"deploy"``, ``""`` (a root ``_*.py``), or ``None`` for other modules."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in NO_LIGHTNING_LAYERS:
        return parts[1]
    if len(parts) == 2 and parts[1].startswith("_") and parts[1] != "__main__":
        return ""
    return None


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT.parent)}:{line}"


# --------------------------------------------------------------------------------------------- fresh interpreters

_PROBE = """
import json, sys
import {target}
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {lightning!r})))
"""


@pytest.fixture(scope="module")
def layer_probes() -> Iterator[Probes]:
    """One fresh interpreter per layer, all started together (tests/_probes.py)."""
    started = Probes()
    started.start(
        {layer: _PROBE.format(target=f"{PACKAGE}.{layer}", lightning=LIGHTNING) for layer in NO_LIGHTNING_LAYERS}
    )
    yield started
    started.close()


@pytest.mark.parametrize("layer", NO_LIGHTNING_LAYERS)
def test_lightning_free_layer_loads_no_lightning(layer_probes: Probes, layer: str) -> None:
    assert (ROOT / layer).is_dir(), f"lightning_perf/{layer}/ is missing"
    out = layer_probes.result(layer)
    assert out.returncode == 0, f"`import {PACKAGE}.{layer}` failed:\n{out.stderr[-3000:]}"
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not loaded, f"`import {PACKAGE}.{layer}` loaded {len(loaded)} Lightning modules, e.g. {loaded[:8]}"


# --------------------------------------------------------------------------------------------------- import graph


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of this package: first line}."""
    graph: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module, imports in IMPORTS.items():
        for imp in imports:
            target = _resolve(imp.target)
            if target is not None and target != module:
                graph[module].setdefault(target, imp.line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_one_cycle(graph, set(c)) for c in components]


def _one_cycle(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first search back to it)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in graph[node]:
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError("a strongly connected component without a cycle")


def _describe_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} -> {b} ({_where(a, graph[a][b])})" for a, b in itertools.pairwise(cycle)]
    return "\n    ".join(steps)


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s) between modules of {PACKAGE}:\n" + "\n".join(
        f"  {i + 1}.\n    {_describe_cycle(graph, cycle)}" for i, cycle in enumerate(cycles)
    )


def test_cycle_finder_finds_cycles() -> None:
    # The finder itself: a two-module circle inside functions and a three-module one are both reported, a chain not.
    graph = {"a": {"b": 1}, "b": {"a": 1}, "c": {"d": 1}, "d": {"e": 1}, "e": {"c": 1}, "f": {"a": 1}}
    found = sorted(tuple(c) for c in _cycles(graph))
    assert found == [("a", "b", "a"), ("c", "d", "e", "c")]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_relative_and_submodule_imports_are_resolved(tmp_path: Path) -> None:
    # `from lightning_perf.profiling import stats`-style imports name the submodule, not the package.
    fake = tmp_path / "fake.py"
    fake.write_text("from . import stats\nfrom .. import functional\n\ndef f():\n    from .timer import PhaseTimer\n")
    resolved = {_resolve(i.target) for i in _imports_of(f"{PACKAGE}.profiling.fake", fake)}
    assert resolved == {f"{PACKAGE}.profiling.stats", f"{PACKAGE}.functional", f"{PACKAGE}.profiling.timer"}
    targets = {_resolve(i.target) for i in IMPORTS[f"{PACKAGE}.profiling.timer"]}
    assert f"{PACKAGE}.profiling.stats" in targets
    package_targets = {_resolve(i.target) for i in IMPORTS[f"{PACKAGE}.profiling"]}
    assert f"{PACKAGE}.profiling.stats" in package_targets


# ------------------------------------------------------------------------------------------------------ file sizes


def test_no_file_over_max_lines() -> None:
    long = {
        str(path.relative_to(ROOT.parent)): n
        for path in sorted(ROOT.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in long.items())


# ---------------------------------------------------------------------------------------------------------- layers


def _layer_violations() -> list[str]:
    problems = []
    for module, imports in IMPORTS.items():
        layer = _layer(module)
        if layer is None:
            continue
        for imp in imports:
            top = imp.target.split(".")[0]
            if top in LIGHTNING:
                problems.append(f"{_where(module, imp.line)} imports {imp.target} (a no-Lightning layer)")
                continue
            target = _resolve(imp.target)
            if target is None:
                continue
            parts = target.split(".")
            sub = parts[1] if len(parts) > 1 else ""
            if sub in HIGHER_LAYERS or sub in FORBIDDEN_WITHIN_LOW[layer]:
                problems.append(f"{_where(module, imp.line)} imports {target} (a higher layer than {layer or 'root'})")
    return problems


def test_layers_import_only_downward() -> None:
    problems = _layer_violations()
    assert not problems, f"{len(problems)} import(s) against the layer rule:\n  " + "\n  ".join(problems)


def test_benchmark_never_imports_the_cli_or_argparse() -> None:
    # The CLI parses its options into a spec and hands it to benchmark/ (bench and --tasks alike); nothing climbs back,
    # and benchmark/ checks settings itself (spec.parse_setting), never through an argparse parser.
    climbs = [
        f"{_where(module, imp.line)} imports {imp.target}"
        for module, imports in IMPORTS.items()
        if module.startswith(f"{PACKAGE}.benchmark")
        for imp in imports
        if (_resolve(imp.target) or imp.target).startswith((f"{PACKAGE}.cli", "argparse"))
    ]
    assert not climbs, "benchmark/ imports the CLI or argparse:\n  " + "\n  ".join(climbs)


# ---------------------------------------------------------------------------------------------- unsafe loading


# Loaders that run a file's code (unpickling, bytecode, generated Python), whatever their arguments.
_CODE_LOADERS = {f"{m}.{f}" for m in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "joblib")
                 for f in ("load", "loads", "Unpickler")}  # fmt: skip
_CODE_LOADERS |= {"torch.jit.load", "torch.export.load", "torch.package.PackageImporter", "shelve.open", "exec", "eval"}
_CODE_LOADERS |= {"yaml.unsafe_load", "yaml.full_load", "yaml.load"}  # yaml.load only with SafeLoader (below)


def _unsafe_loads(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that can execute a file's code: pickle-like loaders, ``torch.load`` without ``weights_only=True``,
    ``numpy.load`` allowing pickles, and ``load_cache_artifacts`` (torch unpickles and runs the compile artifacts)
    in a module that checks no HMAC (``hmac.compare_digest``) before it."""
    names = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = []
    for node in ast.walk(tree):
        weights_only_value = node.value if isinstance(node, ast.keyword) and node.arg == "weights_only" else None
        if weights_only_value is not None and not (
            isinstance(weights_only_value, ast.Constant) and weights_only_value.value is True
        ):
            found.append((weights_only_value.lineno, f"weights_only={ast.unparse(weights_only_value)}"))
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if name in _CODE_LOADERS and not (name == "yaml.load" and "SafeLoader" in keywords.get("Loader", "")):
            found.append((node.lineno, f"{name}(...)"))
        elif name.endswith("load_cache_artifacts") and "hmac.compare_digest" not in names:
            found.append((node.lineno, f"{name}(...) without an HMAC check in the module"))
        elif name in ("np.load", "numpy.load") and keywords.get("allow_pickle", "False") != "False":
            found.append((node.lineno, f"{name}(..., allow_pickle={keywords['allow_pickle']})"))
        elif name in ("torch.load", "load") or name.endswith("serialization.load"):
            if name == "load" and not _is_torch_load_alias(tree):
                continue
            weights_only = next((k for k in node.keywords if k.arg == "weights_only"), None)
            if weights_only is None:
                found.append((node.lineno, f"{name}(...) without weights_only=True"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle", "cPickle", "dill", "marshal"):
            for alias in node.names:
                if alias.name in ("load", "loads", "Unpickler"):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    return found


def _is_torch_load_alias(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and n.module == "torch" and any(a.name == "load" for a in n.names)
        for n in ast.walk(tree)
    )


def test_no_unsafe_loading() -> None:
    problems = []
    for module, tree in TREES.items():
        for line, what in _unsafe_loads(tree):
            problems.append(f"{_where(module, line)}: {what}")
    assert not problems, "loading that can execute a file's code:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("import torch\ntorch.load(f)", True),
        ("import torch\ntorch.load(f, weights_only=False)", True),
        ("import torch\ntorch.load(f, weights_only=flag)", True),
        ("import torch\ntorch.load(f, map_location='cpu', weights_only=True)", False),
        ("import pickle\npickle.loads(b)", True),
        ("import pickle\npickle.load(f)", True),
        ("from pickle import loads", True),
        ("from torch import load\nload(f)", True),
        ("import pickle\npickle.dumps(x)", False),
        ('"""torch.load(f, weights_only=False) in a docstring"""', False),
        ("json.loads(s)", False),
        ("import marshal\nmarshal.loads(b)", True),
        ("exec(text)", True),
        ("model.eval()", False),
        ("import numpy as np\nnp.load(f, allow_pickle=True)", True),
        ("import numpy as np\nnp.load(f)", False),
        ("import yaml\nyaml.load(f, Loader=yaml.SafeLoader)", False),
        ("import yaml\nyaml.load(f, Loader=yaml.Loader)", True),
        ("torch.compiler.load_cache_artifacts(data)", True),
        ("import hmac\nhmac.compare_digest(a, b)\ntorch.compiler.load_cache_artifacts(data)", False),
        ("torch.jit.load(f)", True),
    ],
)
def test_unsafe_loading_scan(source: str, flagged: bool) -> None:
    assert bool(_unsafe_loads(ast.parse(source))) is flagged
