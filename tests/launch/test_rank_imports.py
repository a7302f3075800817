"""What a launch's ranks will import, read from the code before they start (issue 60,
``launch/starting/rank_imports``): the function's import statements and those of the user's code
it reaches, the modules of the libraries' objects it names, torch._dynamo where it trains, what
earlier ranks of the same function said; never the standard library, the notebook's machinery or
the user's own modules, and nothing is imported or run to find out."""

from __future__ import annotations

import functools
import sys
import types

import torch

from nblaunch.launch.starting import rank_imports
from nblaunch.launch.starting.rank_imports import TRAINS, reported, wanted
from preload_helpers import Installed

AdamW = torch.optim.AdamW


def names(function, args=()) -> list[str]:
    return [name for name, _ in wanted(function, args)]


def imports_inside():
    import json  # the standard library: never wanted
    from sklearn.datasets import load_digits
    import torch.distributed as dist

    return json, load_digits, dist


def test_the_functions_own_import_statements_are_read_with_the_names_a_from_import_takes():
    found = wanted(imports_inside)
    assert ("sklearn.datasets", ("load_digits",)) in found
    assert "torch.distributed" in names(imports_inside)
    assert "json" not in names(imports_inside)
    assert TRAINS not in names(imports_inside)  # nothing in it trains


def helper_of_the_notebook():
    from sklearn.linear_model import LinearRegression

    return LinearRegression


class Model:
    def build(self):
        from sklearn.preprocessing import StandardScaler

        return StandardScaler


def reaches_the_users_code(argument_function):
    helper_of_the_notebook()
    Model().build()
    return argument_function


def test_the_users_own_functions_classes_closures_and_arguments_are_read_too():
    def in_a_closure():
        from sklearn.cluster import KMeans

        return KMeans

    def launched():
        in_a_closure()
        return reaches_the_users_code(None)

    def given_as_an_argument():
        from sklearn.svm import SVC

        return SVC

    found = names(launched, (functools.partial(given_as_an_argument),))
    for module in ("sklearn.linear_model", "sklearn.preprocessing", "sklearn.cluster", "sklearn.svm"):
        assert module in found, found


def trains_with_a_global_optimizer(model):
    return AdamW(model.parameters())


def trains_with_torch_optim(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.1)


def compiles(model):
    return torch.compile(model)


def only_computes(x):
    return torch.relu(x) + 1


def test_code_that_trains_wants_torch_dynamo_which_a_first_optimizer_imports():
    for function in (trains_with_a_global_optimizer, trains_with_torch_optim, compiles):
        assert TRAINS in names(function), function
    assert TRAINS not in names(only_computes)


def test_the_libraries_a_function_names_are_wanted_for_ranks_that_unpickle_it():
    installed = Installed()
    try:
        package = installed.package("")
        with open(f"{installed.site}/{package}/loaders.py", "w") as loaders:
            loaders.write("def load():\n    return 1\n")
        load = __import__(f"{package}.loaders").loaders.load

        def uses_a_global():
            return load()

        assert f"{package}.loaders" in names(uses_a_global)
    finally:
        installed.clean()
        for name in [n for n in sys.modules if n.startswith(package)]:
            del sys.modules[name]


def test_nothing_lazy_is_asked_for_while_reading(tmp_path):
    installed = Installed()
    try:
        package = installed.package("import sys\ndef __getattr__(name):\n"
                                    "    sys.modules[__name__].ASKED = name\n    raise AttributeError(name)\n")
        module = __import__(package)
        scope = {package: module}
        exec(f"def reads_a_lazy_name():\n    return {package}.Heavy\n", scope)
        wanted(scope["reads_a_lazy_name"])
        assert not hasattr(module, "ASKED")  # its __getattr__ (a lazy import) was never run
    finally:
        installed.clean()
        sys.modules.pop(package, None)


def test_the_users_own_modules_the_standard_library_and_the_notebooks_machinery_are_never_wanted(tmp_path):
    mine = types.ModuleType("nbl_users_module")
    mine.__file__ = str(tmp_path / "nbl_users_module.py")
    scope = {"mine": mine}
    exec("def uses():\n    import nbl_users_module, asyncio, IPython, ipykernel\n    return mine\n", scope)
    assert names(scope["uses"]) == []


def test_what_earlier_ranks_said_they_imported_is_wanted_by_the_next_launch_of_the_same_function():
    def dynamic(package):
        return __import__(package)

    def another():
        return 1

    assert "sklearn" not in names(dynamic)
    reported(dynamic, ["sklearn", "sklearn.utils", "IPython", "json"])
    assert names(dynamic)[:2] == ["sklearn", "sklearn.utils"] and "IPython" not in names(dynamic)
    assert "sklearn" not in names(another)  # what one function's ranks said is that function's


def test_reading_is_bounded_for_code_that_reaches_a_lot_of_code():
    scope: dict = {}
    source = "\n".join(f"def f{i}():\n    f{i + 1}()\n    import sklearn.cluster" for i in range(1000))
    exec(source + "\ndef f1000():\n    pass\n", scope)
    for i in range(1001):
        scope[f"f{i}"].__module__ = "__main__"
    assert names(scope["f0"]) == ["sklearn.cluster"]  # read up to the bound, then stopped
    assert rank_imports._MOST_CODE < 1000


def imports_on_some_paths(optional):
    try:
        import sklearn.svm  # every run tries it
    except ImportError:
        import sklearn.cluster  # only when that failed
    for _ in range(2):
        import sklearn.linear_model  # a loop's body runs
    if optional:
        import sklearn.neighbors  # only sometimes
    else:
        import sklearn.ensemble
    return sklearn


def test_what_only_some_runs_import_is_left_to_be_learned():
    found = names(imports_on_some_paths)
    assert "sklearn.svm" in found and "sklearn.linear_model" in found
    assert not {"sklearn.cluster", "sklearn.neighbors", "sklearn.ensemble"} & set(found)
