"""The package's layout, read from its source: the import graph of hf_posenc has no cycle (counting the imports
under `if TYPE_CHECKING:`, which a type checker and a reader follow), the engine imports only the engine, the methods
import nothing from the engine (the engine calls a method, never the method the engine: a method's fast kernels are
the engine's, engine/kernels/), the checkpoint code imports only the engine and itself, and neither reaches a module
by a dynamic import (which would hide it from this graph and from the module closure that standalone export ships)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import hf_posenc

PACKAGE_DIR = Path(hf_posenc.__file__).parent
# The engine: what a patch is and does. It imports nothing else of hf_posenc.
ENGINE = ("hf_posenc.engine", "hf_posenc.methods", "hf_posenc.families", "hf_posenc.registry", "hf_posenc.config",
          "hf_posenc.errors", "hf_posenc.model_info", "hf_posenc.version")
CHECKPOINTS = ("hf_posenc.checkpoints",)
METHODS = ("hf_posenc.methods",)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(module: str) -> bool:
    return (PACKAGE_DIR.parent / module.replace(".", "/") / "__init__.py").is_file()


def exists(module: str) -> bool:
    base = PACKAGE_DIR.parent / module.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def import_statements(tree: ast.AST, type_checking: bool = False):
    """Every import statement that can run, at any depth (imports inside functions run too); those under
    `if TYPE_CHECKING:`, which never run, only with `type_checking`."""
    skipped = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                skipped |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            and id(node) not in skipped]


def imported_modules(module: str, tree: ast.AST, type_checking: bool = False) -> set[str]:
    """Every hf_posenc module that importing `module` may import: the modules its import statements name and, for
    a module outside a package, that package's __init__ (Python runs it first)."""
    package = module if is_package(module) else module.rpartition(".")[0]
    named = set()
    for node in import_statements(tree, type_checking):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names if alias.name.split(".")[0] == "hf_posenc"}
            continue
        base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
            else node.module
        if base is None or base.split(".")[0] != "hf_posenc":
            continue
        # `from package import name` imports the submodule package.name when there is one
        submodules = {f"{base}.{alias.name}" for alias in node.names if exists(f"{base}.{alias.name}")}
        named |= submodules or {base}
    parents = {target.rsplit(".", depth)[0] for target in named for depth in range(1, target.count("."))}
    return named | {parent for parent in parents if not (module + ".").startswith(parent + ".")}


def dynamic_imports(tree: ast.AST) -> list[str]:
    """Calls that import a module by a name computed at run time."""
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("importlib.import_module", "import_module", "__import__"):
                calls.append(ast.unparse(node))
    return calls


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = module_name(path)
        graph[module] = imported_modules(module, ast.parse(path.read_text(encoding="utf-8")), type_checking)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    done, path, on_path = set(), [], set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph.get(module, ())):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def in_area(module: str, area: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in area)


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"hf_posenc", "hf_posenc.patching", "hf_posenc.engine.install", "hf_posenc.checkpoints.saving",
            "hf_posenc.methods.alibi", "hf_posenc.families.bloom"} <= set(graph)
    assert "hf_posenc.engine.attention" in graph["hf_posenc.families.base"]
    # `from .engine import attention` imports the submodule (and its package's __init__, which runs first)
    assert graph["hf_posenc.attention"] == {"hf_posenc.engine", "hf_posenc.engine.attention"}
    # importing methods.base from outside runs methods/__init__.py, which imports every method
    assert {"hf_posenc.methods", "hf_posenc.methods.base"} <= graph["hf_posenc.engine.install"]
    assert "hf_posenc.methods" not in graph["hf_posenc.methods.alibi"]  # inside the package: already running
    # nested imports count (model_card reads the engine inside a function); `if TYPE_CHECKING:` ones never run
    assert "hf_posenc.engine.install" in graph["hf_posenc.checkpoints.model_card"]
    assert graph["hf_posenc.registry"] == {"hf_posenc.config", "hf_posenc.errors"}


def test_no_import_cycle():
    for type_checking in (False, True):
        graph = import_graph(type_checking)
        assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_type_checking_imports_are_read_for_the_cycle_check():
    source = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .families.base import ModelFamily\n")
    assert imported_modules("hf_posenc.registry", source) == set()
    assert imported_modules("hf_posenc.registry", source, type_checking=True) == {
        "hf_posenc.families", "hf_posenc.families.base"}
    # the circle such an import made: registry -> families.base -> engine.hybrid -> registry
    graph = import_graph(type_checking=True)
    graph["hf_posenc.registry"] = graph["hf_posenc.registry"] | {"hf_posenc.families.base"}
    graph["hf_posenc.families.base"] = graph["hf_posenc.families.base"] | {"hf_posenc.engine.hybrid"}
    assert find_cycle(graph) is not None


def test_the_methods_import_nothing_from_the_engine():
    """A method says what it computes; the engine finds its kernels (engine/kernels/by_method.py) and its caches."""
    for type_checking in (False, True):
        wrong = {(module, target) for module, targets in import_graph(type_checking).items()
                 if in_area(module, METHODS) for target in targets if in_area(target, ("hf_posenc.engine",))}
        assert not wrong, sorted(wrong)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_engine_imports_only_the_engine():
    wrong = {(module, target) for module, targets in import_graph().items() if in_area(module, ENGINE)
             for target in targets if not in_area(target, ENGINE)}
    assert not wrong, sorted(wrong)


def test_the_checkpoint_code_imports_only_the_engine_and_itself():
    wrong = {(module, target) for module, targets in import_graph().items() if in_area(module, CHECKPOINTS)
             for target in targets if not in_area(target, ENGINE + CHECKPOINTS)}
    assert not wrong, sorted(wrong)


def test_engine_and_checkpoints_import_nothing_dynamically():
    found = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        module = module_name(path)
        if in_area(module, ENGINE + CHECKPOINTS):
            calls = dynamic_imports(ast.parse(path.read_text(encoding="utf-8")))
            if calls:
                found[module] = calls
    assert not found, found


def test_the_readme_method_table_lists_exactly_the_registered_methods():
    import re

    readme = (PACKAGE_DIR.parent / "README.md").read_text()
    table = readme.split("## Methods", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.MULTILINE)
    assert sorted(listed) == sorted(hf_posenc.available_methods())
    assert len(listed) == len(set(listed))


def line_counts(directory: Path) -> dict[str, int]:
    return {path.relative_to(PACKAGE_DIR.parent).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
            for path in sorted(directory.rglob("*.py"))}


def test_no_file_of_the_package_is_over_600_lines():
    long = {path: lines for path, lines in line_counts(PACKAGE_DIR).items() if lines > 600}
    assert not long, long


def test_each_attention_path_is_one_file_under_500_lines():
    """engine/attention/: the dispatcher, the geometry, each path and the path choice in files a reader takes in."""
    counts = line_counts(PACKAGE_DIR / "engine" / "attention")
    assert {"hf_posenc/engine/attention/dispatch.py", "hf_posenc/engine/attention/bias_path.py",
            "hf_posenc/engine/attention/near_far.py", "hf_posenc/engine/attention/content_path.py",
            "hf_posenc/engine/attention/paths.py"} <= set(counts)
    long = {path: lines for path, lines in counts.items() if lines >= 500}
    assert not long, long
