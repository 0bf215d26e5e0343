"""The dependency rules of docs/design.md §1, checked on the import statements of every .py file.

Every import counts: those inside functions and those under `if TYPE_CHECKING:` too (a type
annotation is a dependency of the design even where it costs nothing at run time).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "common",
    "sampling",
    "protos",
    "models",
    "engine",
    "pdspec",
    "prefill_node",
    "decode_node",
    "bench",
    "tests",
)

# Bottom to top. A module imports modules of lower layers, and of its own package in its own
# layer; never a higher layer, nor another package of its layer. A package named here takes
# all its modules but those named on their own; pdspec/ is placed module by module.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground helpers", ("common",)),
    ("sampling", ("sampling",)),
    ("protos", ("protos",)),
    ("models", ("models",)),
    ("engine", ("engine",)),
    (
        "node shell",
        (
            "pdspec",
            "pdspec.config",
            "pdspec.logs",
            "pdspec.metrics",
            "pdspec.modelspec",
            "pdspec.serving",
            "pdspec.tls",
        ),
    ),
    ("nodes", ("prefill_node", "decode_node")),
    (
        "entry points",
        (
            "pdspec.cli",
            "pdspec.client",
            "pdspec.healthcheck",
            "pdspec.local",
            "pdspec.train_draft",
            "prefill_node.__main__",
            "decode_node.__main__",
        ),
    ),
    ("bench and tests", ("bench", "tests")),  # both use every package, never each other
)
SPLIT_PACKAGES = {"pdspec"}  # a new module of these must be placed in LAYERS by name

# sampling/ is math: from the project it takes only itself and the host <-> device copies,
# and no wire or model library
SAMPLING_MAY_IMPORT = {"common.transfer"}
SAMPLING_FORBIDDEN_LIBRARIES = {"grpc", "google", "transformers", "tokenizers", "safetensors", "gguf"}
# what a host <-> device copy helper is made of; common/transfer.py holds the one implementation
COPY_CALLS = {"pin_memory", "record_stream"}
COPY_KEYWORDS = {"non_blocking", "pin_memory"}
# a vocabulary mapping is a scatter over the vocabulary: sampling/d2t.py does it, protos/ never
MAPPING_CALLS = {"scatter_add", "scatter_add_", "index_add", "index_add_"}
MODELS_MAY_IMPORT_FROM_PROTOS = {"protos.contract", "protos.kv_layout"}  # the contract and the KV layout, not the wire
ENGINE_CONSTANTS_MODULE = "engine.options"  # the one public place of the engine's constants


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a project module, or a library's top-level name)
    names: tuple[str, ...]  # names taken with `from target import ...`; () for a module
    where: str  # file:line

    def __str__(self) -> str:
        taken = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.where}: {self.source} imports {self.target}{taken}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {
    _module_name(path): path
    for package in PACKAGES
    for path in sorted((ROOT / package).rglob("*.py"))
    if "__pycache__" not in path.parts
}
TREES = {module: ast.parse(path.read_text(), str(path)) for module, path in FILES.items()}


def _project_module(name: str) -> str | None:
    """The longest prefix of a dotted name that is a project module."""
    while name and name not in FILES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, tree: ast.Module) -> list[Import]:
    where = FILES[module].relative_to(ROOT)
    package = module if FILES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):  # every level: function bodies and TYPE_CHECKING blocks too
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _project_module(alias.name) or alias.name.partition(".")[0]
                found.append(Import(module, target, (), at))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in FILES:  # a submodule
                    found.append(Import(module, f"{base}.{alias.name}", (), at))
                else:
                    names.append(alias.name)
            if names:
                target = _project_module(base) or base.partition(".")[0]
                found.append(Import(module, target, tuple(names), at))
    return found


IMPORTS = [imp for module, tree in TREES.items() for imp in _imports(module, tree)]
PROJECT_IMPORTS = [imp for imp in IMPORTS if imp.target in FILES and imp.target != imp.source]


def _top(module: str) -> str:
    return module.partition(".")[0]


_LAYER_OF = {entry: index for index, (_, entries) in enumerate(LAYERS) for entry in entries}


def layer(module: str) -> int | None:
    if module in _LAYER_OF:
        return _LAYER_OF[module]
    return None if _top(module) in SPLIT_PACKAGES else _LAYER_OF.get(_top(module))


def _report(rule: str, bad: list) -> str:
    return f"{rule} (docs/design.md §1):\n  " + "\n  ".join(str(b) for b in bad)


def test_every_module_has_a_layer():
    unplaced = sorted(module for module in FILES if layer(module) is None)
    if unplaced:
        pytest.fail(f"place these modules in LAYERS (tests/test_layering.py): {unplaced}")


def _against_layers(imp: Import) -> bool:
    src, dst = layer(imp.source), layer(imp.target)
    if src is None or dst is None:  # test_every_module_has_a_layer names it
        return False
    return dst > src or (dst == src and _top(imp.source) != _top(imp.target))


def _why(imp: Import) -> str:
    src, dst = layer(imp.source), layer(imp.target)
    if src == dst:
        return f"{_top(imp.target)}/ is another package of the layer '{LAYERS[src][0]}'"
    return f"the layer '{LAYERS[src][0]}' may not import the higher layer '{LAYERS[dst][0]}'"


def test_imports_follow_the_layers():
    bad = [f"{imp}: {_why(imp)}" for imp in PROJECT_IMPORTS if _against_layers(imp)]
    if bad:
        pytest.fail(_report("imports against the layers " + " < ".join(name for name, _ in LAYERS), bad))


def _cycle_in(component: set[str], edges: dict[str, dict[str, Import]]) -> list[Import]:
    """One cycle through the first module of a strongly connected component, as its imports."""
    start = min(component)
    paths = {start: []}
    queue = [start]
    while queue:  # breadth first: the shortest cycle back to `start`
        module = queue.pop(0)
        for target, imp in sorted(edges[module].items()):
            if target == start:
                return [*paths[module], imp]
            if target in component and target not in paths:
                paths[target] = [*paths[module], imp]
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")


def _components(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    edges: dict[str, dict[str, Import]] = {module: {} for module in FILES}
    for imp in PROJECT_IMPORTS:
        edges[imp.source].setdefault(imp.target, imp)  # the first import of the pair speaks for it
    cycles = [
        " -> ".join([cycle[0].source, *(f"{imp.target} [{imp.where}]" for imp in cycle)])
        for cycle in (_cycle_in(component, edges) for component in _components(edges))
    ]
    if cycles:
        pytest.fail(_report("import cycles", cycles))


def _calls(module: str, attributes: set[str], keywords: set[str]) -> list[str]:
    """Calls of `.attribute(...)` or with `keyword=` in a module, as file:line: what."""
    where = FILES[module].relative_to(ROOT)
    found = []
    for node in ast.walk(TREES[module]):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in attributes:
            found.append(f"{where}:{node.lineno}: {module} calls .{node.func.attr}()")
        found += [f"{where}:{node.lineno}: {module} passes {kw.arg}=" for kw in node.keywords if kw.arg in keywords]
    return found


def _in(package: str) -> list[str]:
    return [module for module in FILES if _top(module) == package]


def test_sampling_is_math_only():
    bad: list[object] = [
        imp
        for imp in IMPORTS
        if _top(imp.source) == "sampling"
        and (
            (imp.target in FILES and _top(imp.target) != "sampling" and imp.target not in SAMPLING_MAY_IMPORT)
            or imp.target in SAMPLING_FORBIDDEN_LIBRARIES
        )
    ]
    bad += [call for module in _in("sampling") for call in _calls(module, COPY_CALLS, COPY_KEYWORDS)]
    rule = (
        f"sampling/ imports only itself and {sorted(SAMPLING_MAY_IMPORT)}, no wire or model library,"
        " and copies nothing between host and device itself"
    )
    if bad:
        pytest.fail(_report(rule, bad))


def test_protos_maps_no_vocabulary():
    generated = [module for module in _in("protos") if "_pb2" in module]
    bad = [call for module in _in("protos") if module not in generated for call in _calls(module, MAPPING_CALLS, set())]
    if bad:
        pytest.fail(_report("protos/ validates, the draft -> target mapping is sampling/d2t.py's", bad))


def test_models_take_only_the_contract_from_protos():
    bad = [
        imp
        for imp in PROJECT_IMPORTS
        if _top(imp.source) == "models"
        and _top(imp.target) == "protos"
        and imp.target not in MODELS_MAY_IMPORT_FROM_PROTOS
    ]
    if bad:
        pytest.fail(_report(f"models/ imports from protos/ only {sorted(MODELS_MAY_IMPORT_FROM_PROTOS)}", bad))


def test_pdspec_uses_only_public_engine_names():
    bad = [
        imp
        for imp in PROJECT_IMPORTS
        if _top(imp.source) == "pdspec"
        and _top(imp.target) == "engine"
        and (
            any(name.startswith("_") for name in (*imp.names, imp.target.rpartition(".")[2]))
            or (imp.target != ENGINE_CONSTANTS_MODULE and any(name.isupper() for name in imp.names))
        )
    ]
    rule = f"pdspec/ imports no private engine name, and the engine's constants only from {ENGINE_CONSTANTS_MODULE}"
    if bad:
        pytest.fail(_report(rule, bad))
