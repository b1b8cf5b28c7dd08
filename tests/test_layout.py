"""The layout keeps its promises (docs/architecture.md, "Layout"): no import cycles, the decoding loops import
the Target and Drafter interfaces, never a family module, and no two pytree classes share a tree structure."""
import ast
import collections
import dataclasses
import importlib
import inspect
import pathlib

import jax
from flax import struct

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dflash_jax", "pallas_kernels")  # the kernels too: one importing the library closed a cycle once


def _modules() -> dict:
    """Module name -> path of every module of the packages (assets excluded)."""
    out = {}
    for path in (p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        if "assets" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict:
    """Module -> the package modules it imports (`from a.b import c` names `a.b.c` when that is a module)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGES):
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith(PACKAGES)}
        # importing a.b.c runs the __init__ of a and a.b first (unless the importer lives inside them)
        edges |= {".".join(e.split(".")[:i]) for e in edges for i in range(1, e.count(".") + 1)}
        graph[name] = {e for e in edges if e in mods and e != name and not name.startswith(e + ".")}
    return graph


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert len(graph) > 20, f"the packages' modules were not found under {ROOT}"
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["dflash_jax.targets.base"] = graph["dflash_jax.targets.base"] | {"dflash_jax.decoding.common"}
    assert _cycle(graph) is not None, "decoding.common imports targets.base, so the planted edge closes a cycle"


def test_decoding_imports_only_the_interfaces():
    graph = import_graph()
    families = {m for m in graph if m.count(".") == 2 and m.split(".")[1] in ("targets", "drafters")
                and not m.endswith(".base")}
    assert "dflash_jax.targets.dense" in families and "dflash_jax.drafters.dflash" in families
    for module, imports in graph.items():
        if module.startswith("dflash_jax.decoding"):
            assert not imports & families, f"{module} imports family modules {sorted(imports & families)}"


def pytree_dataclasses() -> list:
    """Every pytree dataclass of the packages (flax's `struct.dataclass` and `PyTreeNode` mark theirs)."""
    out = set()
    for name in _modules():
        if name.endswith("__main__"):  # it would run the command line
            continue
        for obj in vars(importlib.import_module(name)).values():
            if inspect.isclass(obj) and obj.__module__.startswith(PACKAGES) and getattr(obj, "_flax_dataclass", False):
                out.add(obj)
    return sorted(out, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def shared_layouts(classes) -> list:
    """Groups of classes with the same fields (names, and which are static) that do not keep their class in a static
    `node_type` field: JAX compares their tree structures by the static values alone, so their instances may be
    taken for one another by compiled-program caches (docs/architecture.md, "The Target interface")."""
    groups = collections.defaultdict(list)
    for cls in classes:
        fields = tuple((f.name, f.metadata.get("pytree_node", True)) for f in dataclasses.fields(cls))
        if ("node_type", False) not in fields:
            groups[fields].append(cls.__name__)
    return [names for names in groups.values() if len(names) > 1]


def test_no_two_pytree_classes_share_a_tree_structure():
    classes = pytree_dataclasses()
    names = {c.__name__ for c in classes}
    assert {"DenseTarget", "HybridTarget", "DFlashDrafter", "DSparkDrafter", "KVCache", "OneHotQ"} <= names
    assert shared_layouts(classes) == []

    @struct.dataclass
    class PlantedTwin:
        config: int = struct.field(pytree_node=False)
        params: dict

    @struct.dataclass
    class PlantedOther:
        config: int = struct.field(pytree_node=False)
        params: dict

    assert jax.tree_util.tree_structure(PlantedTwin(1, {})) == jax.tree_util.tree_structure(PlantedOther(1, {}))
    assert shared_layouts([*classes, PlantedTwin, PlantedOther]) == [["PlantedTwin", "PlantedOther"]]
