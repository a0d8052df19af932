"""The import graph of ``verispec/``: no cycle, and no module importing a layer above its own.

Every import counts, wherever it is written: at the top of a module, inside a function, or under
``TYPE_CHECKING``. The source is parsed with ``ast``, nothing is imported, so a cycle hidden inside a function
(which Python tolerates at run time) fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "verispec"

# The layers, lowest first (ARCHITECTURE.md): a module imports its own layer or lower ones, never a layer above
# nor another layer of its own rank. "" is the package's public facade (verispec/__init__.py), above everything.
LAYERS: list[set[str]] = [
    {"core", "text", "telemetry", "version"},  # pure tensor code and plain Python: tokens to text, counters
    {"acquire"},  # a name to checked local files: the zoo, its packages and sha256, Hub ids, GGUF tokenizers
    {"models"},  # the backends: a model from its files, its cache with rollback
    {"drafters", "policy"},  # proposing drafts; choosing how many
    {"decode"},  # the loop: propose, score, verify, accept, roll back
    {"factory"},  # names -> models, drafters, policy, decoder
    {"serving", "offline"},  # the HTTP server; offline jobs
    {"cli"},
    {"__main__"},
    {""},
]
RANK = {layer: rank for rank, group in enumerate(LAYERS) for layer in group}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """``verispec.serving.app`` -> ``serving``; ``verispec`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """The verispec modules ``module`` (at ``path``) imports: ``from x import y`` counts as ``x.y`` when that
    is a module, else as ``x`` (a package counts as its ``__init__``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "verispec")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "verispec":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in modules else source)
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {module: imports_of(path, module, set(paths)) for module, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, root_targets in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(root_targets)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
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
                    found.append(sorted(component))
    return found


def test_every_package_of_verispec_has_a_layer() -> None:
    unplaced = {layer(module) for module in import_graph()} - RANK.keys()
    assert not unplaced, f"place {sorted(unplaced)} in LAYERS (tests/test_layers.py) and in ARCHITECTURE.md"


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if layer(target) != layer(module) and RANK[layer(target)] >= RANK[layer(module)]
    )
    assert upward == []


def test_the_checks_can_fail() -> None:
    """The graph is read right: known edges are there, and a made-up cycle is found."""
    graph = import_graph()
    assert "verispec.decode.batch" in graph["verispec.decode.decoder"]
    assert "verispec.models.capability" in graph["verispec.models.cache"]
    assert "verispec.decode" in graph["verispec.factory"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_acquisition_calls_one_way_and_the_backends_know_only_files() -> None:
    """Inside ``acquire`` calls go one way (names -> zoo -> integrity); the backends in ``models`` import the
    package's entry (``resolve``, ``ModelFiles``), never the zoo's packages or the sha256 checks themselves
    (``verispec.models`` itself re-exports ``zoo`` as ``verispec.zoo``)."""
    graph = import_graph()
    assert graph["verispec.acquire.integrity"] == set()
    assert graph["verispec.acquire.zoo"] == {"verispec.acquire.integrity"}
    assert graph["verispec.acquire.sources"] == {"verispec.acquire.zoo", "verispec.acquire.integrity"}
    inner = {"verispec.acquire.zoo", "verispec.acquire.integrity", "verispec.acquire.sources"}
    backends = [module for module in graph if layer(module) == "models" and module != "verispec.models"]
    assert backends and [m for m in backends if graph[m] & inner] == []
