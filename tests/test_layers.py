"""The house's rules, read from the imports (docs/architecture.md draws them): no import
circles, no import from a lower layer to a higher one (a package's own ``__init__`` included: a
module below never imports the package face), no underscore names of ``Launch`` used outside
``launch/``, no file over 400 lines, no folder of more than 16 modules, no two modules of the
same name in different rooms."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nblaunch"

# Lowest first. A module may import from its own layer and the layers below, never above.
LAYERS = [
    ["nblaunch.contract", "nblaunch.wire", "nblaunch.events", "nblaunch.frames", "nblaunch.proctree",
     "nblaunch.environ_watch", "nblaunch.after_import", "nblaunch.machine", "nblaunch.per_process",
     "nblaunch.step_split"],
    ["nblaunch.worker", "nblaunch.display"],
    # training/: one folder per concern, each importing only those before it
    ["nblaunch.training.runtime"],
    ["nblaunch.training.options"],
    ["nblaunch.training.precision"],
    ["nblaunch.training.model"],
    ["nblaunch.training.step"],
    ["nblaunch.training.strategy"],
    ["nblaunch.training.data"],
    ["nblaunch.training.checkpoint"],
    ["nblaunch.training.tracking"],
    ["nblaunch.training.accelerator"],
    ["nblaunch.training"],  # its __init__: the public names
    ["nblaunch.detached"],  # where a launch is kept outside the kernel; knows nothing of launches
    # launch/: what a launch is asked and planned, the processes it starts, how its ranks start
    # (and begin with their imports), then the rest (the Launch, its clusters).
    ["nblaunch.launch.errors", "nblaunch.launch.planning"],
    ["nblaunch.launch.processes"],
    ["nblaunch.launch.starting"],
    ["nblaunch.launch"],
    ["nblaunch.cluster"],
    ["nblaunch.clusters"],
    ["nblaunch.warm"],
    ["nblaunch.api", "nblaunch.demo"],
    ["nblaunch.cli", "nblaunch.__main__", "nblaunch.utils", "nblaunch.logging", "nblaunch.tracking",
     "nblaunch"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> int:
    best, found = -1, -1
    for index, members in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and len(member) > best:
                best, found = len(member), index
    assert found >= 0, f"{module} is in no layer: add it to LAYERS and to docs/architecture.md"
    return found


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    """(imported nblaunch module, line, inside a function) for every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                names = [f"{base}.{alias.name}" for alias in child.names]
                names = [n if n in MODULES else base for n in names]
            else:
                visit(child, inner)
                continue
            for name in names:
                while name and name not in MODULES:
                    name = name.rpartition(".")[0]
                # A parent package counts too: importing it runs its __init__ (the package face).
                if name and name != module:
                    found.append((name, child.lineno, in_function))

    visit(tree, False)
    return found


def test_no_module_imports_from_a_higher_layer():
    upward = [f"{m}:{line} imports {target}{' (in a function)' if inner else ''}"
              for m in MODULES for target, line, inner in imports_of(m) if layer_of(target) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    graph = {m: {target for target, _, _ in imports_of(m)} for m in MODULES}  # inside functions too
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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

    for module in sorted(graph):
        if module not in index:
            strong(module)
    assert not circles, circles


def test_nothing_outside_launch_uses_launchs_underscore_names():
    handle = ast.parse((PACKAGE / "launch" / "handle.py").read_text())
    names = {node.name for node in ast.walk(handle) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {node.attr for node in ast.walk(handle) if isinstance(node, ast.Attribute)}  # self._x = ...
    names |= {node.id for node in ast.walk(handle) if isinstance(node, ast.Name)}  # module globals
    private = {name for name in names if name.startswith("_") and not name.startswith("__")}
    reaching = []
    for module, path in MODULES.items():
        if module.startswith("nblaunch.launch"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                reaching.append(f"{module}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and any(a.name in private for a in node.names):
                reaching.append(f"{module}:{node.lineno} imports a private name of {node.module}")
    assert not reaching, "\n".join(reaching)


@pytest.mark.parametrize("limit", [400])
def test_no_file_is_over_the_limit(limit):
    long = {module: n for module, path in MODULES.items() if (n := len(path.read_text().splitlines())) > limit}
    assert not long, long


def test_no_folder_holds_more_than_16_modules():
    crowded = {str(folder.relative_to(PACKAGE.parent)): n for folder in [PACKAGE, *PACKAGE.rglob("*/")]
               if folder.is_dir() and (n := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > 16}
    assert not crowded, crowded


def test_no_two_modules_share_a_name():
    """A module's name says which room it is in: ``kept_launch`` and ``ray_keeper``, not two ``kept``."""
    by_name: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(module)
    shared = {name: modules for name, modules in by_name.items() if len(modules) > 1}
    assert not shared, shared


def test_every_module_is_named_in_the_architecture():
    """docs/architecture.md is how a newcomer finds their way: every module appears there, in
    code (a backtick span or a drawing), so a new or renamed module is drawn when it lands."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    code = re.findall(r"`([^`\n]+)`", doc) + re.findall(r"```.*?```", doc, re.S)
    code += [line for line in doc.splitlines() if line.startswith("    ")]  # indented drawings
    named = {word for span in code for word in re.findall(r"\w+", span)}
    missing = sorted(str(path.relative_to(PACKAGE.parent)) for path in MODULES.values()
                     if path.stem not in ("__init__", "__main__") and path.stem not in named)
    assert not missing, missing
