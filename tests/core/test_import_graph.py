"""The import graph of src/anyattn: no cycles, and the core imports no backend module
beyond the registry and the Backend interface.

Every module is parsed with ``ast`` (nothing is imported): import statements at any
level count, function-local ones included, with relative imports resolved.
``from pkg import name`` counts as an import of ``pkg.name`` when that is a module,
else of ``pkg`` (its ``__init__``).
Loading by name at run time (``importlib``: the registry's backend entries) is no
edge: that is the registry's job, the one place where the core reaches a backend.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "anyattn"

#: the core: the public API, the problem description and the ABI
CORE_PREFIXES = ("anyattn.api", "anyattn.arguments", "anyattn.problem", "anyattn.masks",
                 "anyattn.modifiers", "anyattn.dropout", "anyattn.rowstats", "anyattn.reference",
                 "anyattn.abi")
#: the only backend modules the core may import
CORE_MAY_IMPORT = frozenset({"anyattn.backends.registry", "anyattn.backends.base"})

#: cycles known and being removed elsewhere, each as the set of its modules (an
#: exception matches only that exact set: a cycle that grows is reported)
KNOWN_CYCLES: List[frozenset] = []


def module_names(src: Path = SRC) -> Dict[str, Path]:
    """Dotted module name -> file, for every .py file under src/anyattn."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: Optional[str]) -> str:
    """The absolute name of ``from <level dots><name> import ...`` inside ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, known: Set[str]) -> Set[str]:
    """The anyattn modules that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: Set[str] = set()

    def nearest(name: str) -> Optional[str]:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else base)
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                hit = nearest(target)
                if hit is not None and hit != module:
                    found.add(hit)
    return found


def import_graph(src: Path = SRC) -> Dict[str, Set[str]]:
    mods = module_names(src)
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycles(graph: Dict[str, Set[str]]) -> List[Tuple[List[str], List[str]]]:
    """[(modules, path)] for every strongly connected component with a cycle (Tarjan):
    its modules, sorted, and a shortest cycle through the first of them, a -> ... -> a."""
    edges = {a: sorted(bs) for a, bs in graph.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    comps: List[List[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        work = [(v, iter(edges[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return [(comp, _cycle_path(edges, comp)) for comp in comps]


def _cycle_path(edges: Dict[str, List[str]], comp: List[str]) -> List[str]:
    """A shortest cycle through the component's first module, as a path a -> ... -> a."""
    inside = set(comp)
    start = comp[0]
    prev: Dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for a in frontier:
            for b in edges[a]:
                if b not in inside:
                    continue
                if b == start:
                    path = [a]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if b not in seen:
                    seen.add(b)
                    prev[b] = a
                    nxt.append(b)
        frontier = nxt
    return comp  # unreachable for a strongly connected component


def _is_core(name: str) -> bool:
    return any(name == c or name.startswith(c + ".") for c in CORE_PREFIXES)


def _back_arrows(graph: Dict[str, Set[str]]) -> List[str]:
    return [f"{a} -> {b}" for a in sorted(graph) if _is_core(a)
            for b in sorted(graph[a])
            if b.startswith(PACKAGE + ".backends") and b not in CORE_MAY_IMPORT]


def test_checker_finds_a_cycle_and_a_back_arrow(tmp_path):
    """The checker itself: a made-up package with a cycle (through a function-local,
    relative import) and a core module importing a backend."""
    pkg = tmp_path / PACKAGE
    (pkg / "backends" / "webgpu").mkdir(parents=True)
    for init in (pkg, pkg / "backends", pkg / "backends" / "webgpu"):
        (init / "__init__.py").write_text("")
    (pkg / "api.py").write_text("from .backends import registry\n"
                                "def f():\n    from .backends.webgpu.resident import zeros\n")
    (pkg / "backends" / "registry.py").write_text("import anyattn.api\n")
    (pkg / "backends" / "webgpu" / "resident.py").write_text("def zeros(): pass\n")
    graph = import_graph(tmp_path)
    assert graph["anyattn.api"] == {"anyattn.backends.registry",
                                    "anyattn.backends.webgpu.resident"}
    assert find_cycles(graph) == [(["anyattn.api", "anyattn.backends.registry"],
                                   ["anyattn.api", "anyattn.backends.registry", "anyattn.api"])]
    assert _back_arrows(graph) == ["anyattn.api -> anyattn.backends.webgpu.resident"]


def test_no_import_cycles():
    graph = import_graph()
    assert "anyattn.api" in graph and len(graph) > 50, "the checker found no modules"
    cycles = [(comp, path) for comp, path in find_cycles(graph)
              if frozenset(comp) not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(
        f"{' -> '.join(path)}\n    (modules in this circle: {', '.join(comp)})"
        for comp, path in cycles)


def test_core_imports_no_backend_module():
    graph = import_graph()
    arrows = _back_arrows(graph)
    assert not arrows, ("core modules import backend modules (allowed: "
                        f"{sorted(CORE_MAY_IMPORT)}):\n" + "\n".join(arrows))


def test_api_calls_only_declared_backend_methods():
    """What the public API asks of a backend (``be.<name>`` in api.py) is declared,
    with a docstring, on the Backend interface: no backend-specific call hides there."""
    from anyattn.backends.base import Backend

    tree = ast.parse((SRC / PACKAGE / "api.py").read_text())
    asked = {node.attr for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
             and node.value.id == "be"}
    assert {"forward", "backward"} <= asked, asked
    undeclared = sorted(n for n in asked if not callable(getattr(Backend, n, None)))
    assert not undeclared, f"api.py calls backend methods Backend does not declare: {undeclared}"
    bare = sorted(n for n in asked if not getattr(Backend, n).__doc__)
    assert not bare, f"Backend methods without a docstring: {bare}"
