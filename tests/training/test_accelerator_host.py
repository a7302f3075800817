"""The Accelerator's groups of methods read only what ``AcceleratorHost`` declares, and the
Accelerator sets exactly that (see docs/architecture.md). The order of training/'s folders is
checked with the rest of the house in tests/test_layers.py."""

import ast
import pathlib

import nblaunch.training
from nblaunch.training.accelerator.communication import CollectiveMethods
from nblaunch.training.accelerator.host import AcceleratorHost
from nblaunch.training.accelerator.persistence import PersistenceMethods
from nblaunch.training.accelerator.prepare import PrepareMethods
from nblaunch.training.accelerator.training_step import TrainingStepMethods

ROOT = pathlib.Path(nblaunch.training.__file__).parent


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
