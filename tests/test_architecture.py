"""The package's shape, held to what docs/architecture.md draws: no import circle anywhere in
``distributed_ext``, and the export's layers (plan < files < transport < rounds < api < convert) each
importing only those below it -- the plan with no process group and no files."""

from __future__ import annotations

import ast
import os

import distributed_ext

ROOT = os.path.dirname(distributed_ext.__file__)
# The export's layers, bottom first: a module may import its own layer and those below.
LAYERS = ["plan", "files", "transport", "rounds", "api", "convert", "__init__"]


def _modules() -> dict[str, str]:
    """Every module of the package: dotted name -> path."""
    out = {}
    for folder, _dirs, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".so"):  # the compiled core: a module that imports nothing here
                out["distributed_ext." + name.split(".")[0]] = ""
            elif name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(ROOT))
                dotted = rel[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = os.path.join(folder, name)
    return out


def _imports(path: str, known: set[str]) -> dict[str, set[str]]:
    """The package's modules ``path`` imports (at any depth of its code, type-only imports
    included), each with the names taken from it (``*`` for the module itself)."""
    if not path:
        return {}
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    found.setdefault(a.name, set()).add("*")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:  # "from package import module"
                    found.setdefault(sub, set()).add("*")
                elif node.module in known:
                    found.setdefault(node.module, set()).add(a.name)
    return found


def _graph() -> dict[str, dict[str, set[str]]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) for m, p in mods.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["distributed_ext", "export"]:
        return None
    return LAYERS.index(parts[2] if len(parts) > 2 else "__init__")


def test_no_module_of_the_package_imports_itself_back():
    graph = {m: set(deps) - {m} for m, deps in _graph().items()}
    # Tarjan's strongly connected components: any with two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    # A package's __init__ is a module here too: a module that takes a name from its own
    # package (not from the module defining it) closes a circle with the __init__ that
    # imports it, and is reported.
    assert not circles, circles


def test_each_layer_of_the_export_imports_only_the_layers_below_it():
    wrong = []
    for module, deps in _graph().items():
        mine = _layer(module)
        if mine is None:
            continue
        for dep in deps:
            theirs = _layer(dep)
            if theirs is not None and theirs > mine:
                wrong.append(f"{module} imports {dep} ({LAYERS[theirs]} is above "
                             f"{LAYERS[mine]})")
    assert not wrong, wrong


# The compiled core's pure arithmetic, which the plan's transforms may call (plan.row_kernels).
_ARITHMETIC = {"fp8_divide", "int4_rows", "map_through_table", "nvfp4_rows", "nvfp4_scales"}


def test_the_plan_has_no_process_group_and_no_files():
    # Pure planning: testable in one process. Allowed from outside the export: the
    # process's own rank (runtime.rank), DTensor types, the files' alignment constant, and
    # the compiled core's arithmetic (no files, no group).
    banned = {"distributed_ext.collectives", "distributed_ext._agree", "distributed_ext._watch",
              "distributed_ext._spawn", "distributed_ext.gather", "distributed_ext._native",
              "distributed_ext._staging", "distributed_ext._device_pipeline"}
    wrong = []
    paths = _modules()
    for module, deps in _graph().items():
        if not module.startswith("distributed_ext.export.plan"):
            continue
        for dep, names in deps.items():
            if dep in banned and not (dep == "distributed_ext._native" and names <= _ARITHMETIC) \
                    or (dep == "distributed_ext._direct_io" and names != {"ALIGN"}):
                wrong.append(f"{module} imports {dep} ({sorted(names)})")
        path = paths[module]
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                wrong += [f"{module} imports {a.name}" for a in node.names
                          if a.name == "torch.distributed"]
            elif isinstance(node, ast.ImportFrom) and node.module == "torch" and \
                    any(a.name == "distributed" for a in node.names):
                wrong.append(f"{module} imports torch.distributed")
    assert not wrong, wrong


def test_the_checks_see_the_whole_package():
    # (so that a test above cannot pass by reading nothing)
    graph = _graph()
    assert {"distributed_ext.export.plan.pieces", "distributed_ext.export.files.sinks",
            "distributed_ext.export.transport.transfer", "distributed_ext.export.rounds",
            "distributed_ext.serialization"} <= set(graph)
    assert "distributed_ext.export.plan.types" in graph["distributed_ext.export.plan.pieces"]


def test_every_subpackage_is_installed():
    # pyproject lists the packages by name: a folder left out would import from a checkout
    # and be missing from a wheel.
    import tomllib

    with open(os.path.join(os.path.dirname(ROOT), "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    folders = {os.path.relpath(folder, os.path.dirname(ROOT)).replace(os.sep, ".")
               for folder, _dirs, files in os.walk(ROOT) if "__init__.py" in files}
    assert folders == listed, (folders - listed, listed - folders)
