"""The shape of ``nblaunch/training/``: each folder imports only the folders below it, and the
Accelerator's groups of methods read only what ``AcceleratorHost`` declares (see
docs/architecture.md)."""

import ast
import pathlib

import nblaunch.training
from nblaunch.training.accelerator.collectives import CollectiveMethods
from nblaunch.training.accelerator.host import AcceleratorHost
from nblaunch.training.accelerator.persistence import PersistenceMethods
from nblaunch.training.accelerator.prepare import PrepareMethods
from nblaunch.training.accelerator.training_step import TrainingStepMethods

ROOT = pathlib.Path(nblaunch.training.__file__).parent
# Lowest first: a folder may import itself and the folders before it.
LAYERS = ["runtime", "options", "model", "step", "data", "checkpoint", "accelerator"]


def _imported_training_folders(path: pathlib.Path) -> set[str]:
    """The training folders ``path`` imports from, at module level or in functions, typing-only included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["nblaunch", "training"] and len(parts) > 2 and parts[2] in LAYERS:
                found.add(parts[2])
    return found


def test_each_folder_imports_only_the_folders_below_it():
    wrong = []
    for folder in LAYERS:
        allowed = set(LAYERS[: LAYERS.index(folder) + 1])
        for path in sorted((ROOT / folder).glob("*.py")):
            for imported in _imported_training_folders(path) - allowed:
                wrong.append(f"{path.relative_to(ROOT)} imports training/{imported}/")
    assert not wrong
    assert sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(LAYERS)


def _names_read_on_self(cls: type) -> set[str]:
    source = pathlib.Path(__import__(cls.__module__, fromlist=["_"]).__file__).read_text()
    tree = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


def _declared(cls: type) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        names |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
    return names


def test_the_accelerators_method_groups_read_only_what_the_host_declares():
    host = _declared(AcceleratorHost)
    for group in (PrepareMethods, TrainingStepMethods, CollectiveMethods, PersistenceMethods):
        own = set(vars(group)) | set(getattr(group, "__annotations__", {}))
        undeclared = _names_read_on_self(group) - host - own
        assert not undeclared, f"{group.__name__} reads {sorted(undeclared)} that AcceleratorHost does not declare"


def test_the_accelerator_sets_exactly_what_the_host_declares():
    from nblaunch.training.accelerator.core import Accelerator

    tree = ast.parse(pathlib.Path(ROOT / "accelerator" / "core.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert assigned == set(AcceleratorHost.__annotations__)
    assert Accelerator.__mro__[-2:] == (AcceleratorHost, object)
