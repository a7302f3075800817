"""Accelerate's own distributed test scripts, run from the installed ``accelerate`` package under
nblaunch's launcher: as they are (Accelerate's ``Accelerator``) and ported to nblaunch by
changing their imports, as README tells a user to.

Every call that ``main()`` makes to one of the script's own functions is a *test call*; one in a
loop counts once per iteration. Each test call runs in a launch of its own (2 CPU ranks): the
script's ``main()`` runs with every other test call skipped, so one failure never hides the next
and a call that desynchronises the ranks only fails itself (``timeout=`` backstop).

Run ``python tests/conformance/accelerate_scripts.py`` for the table (see --help).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import sys
import types
from dataclasses import dataclass

SCRIPTS = (
    "test_script", "test_sync", "test_ops", "test_distributed_data_loop",
    "external_deps/test_metrics", "test_ddp_comm_hook",
)
CALL_TIMEOUT_S = 60  # a call takes seconds; one of Accelerate's hangs under its own code

# The mechanical change README gives: Accelerate's public modules -> nblaunch's. Accelerate's
# test helpers (accelerate.test_utils) are not part of a user's code and stay as they are.
_PORT = [
    (re.compile(r"\baccelerate\.test_utils\b"), "ACCELERATE_TEST_UTILS"),
    (re.compile(r"\baccelerate\.utils(\.[a-z_]+)?\b"), "nblaunch.utils"),
    (re.compile(r"\baccelerate\.logging\b"), "nblaunch.logging"),
    (re.compile(r"\baccelerate\.(accelerator|state|data_loader|local_sgd)\b"), "nblaunch"),
    (re.compile(r"\bfrom accelerate import\b"), "from nblaunch import"),
    (re.compile(r"ACCELERATE_TEST_UTILS"), "accelerate.test_utils"),
]


def script_path(name: str) -> str:
    spec = importlib.util.find_spec("accelerate.test_utils.scripts")
    return os.path.join(os.path.dirname(spec.origin), f"{name}.py")


def port(source: str) -> str:
    """The script with the import change README asks of a user."""
    for pattern, replacement in _PORT:
        source = pattern.sub(replacement, source)
    return source


class _OnlyOneCall(ast.NodeTransformer):
    """Guards every statement in ``main()`` that calls one of the script's own functions with
    ``if __nbl_call__(k):`` so that one chosen (statement, iteration) runs and the rest are skipped."""

    def __init__(self, own_functions: set[str]):
        self.own = own_functions
        self.count = 0

    def visit_Expr(self, node: ast.Expr):
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in self.own:
            index = self.count
            self.count += 1
            guard = ast.Call(ast.Name("__nbl_call__", ast.Load()), [ast.Constant(index)], [])
            return ast.copy_location(ast.If(test=guard, body=[node], orelse=[]), node)
        return node


def instrument(source: str) -> tuple[types.CodeType, int]:
    """The script compiled with its test calls guarded; and how many call statements it has."""
    tree = ast.parse(source)
    own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} - {"main"}
    (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    guard = _OnlyOneCall(own)
    guard.visit(main)
    tree.body = [n for n in tree.body if not (isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))]
    return compile(ast.fix_missing_locations(tree), f"<{'ported ' if 'nblaunch' in source else ''}accelerate script>", "exec"), guard.count


def run_in_rank(name: str, ported: bool, target: tuple[int, int] | None) -> dict[int, int]:
    """In a rank: run the script's main() with only ``target`` = (statement, iteration) called
    (None: none); return how often each call statement was reached."""
    with open(script_path(name)) as f:
        source = f.read()
    code, _ = instrument(port(source) if ported else source)
    reached: dict[int, int] = {}

    def only(index: int) -> bool:
        iteration = reached.get(index, 0)
        reached[index] = iteration + 1
        return target == (index, iteration)

    module = types.ModuleType(f"accelerate_conformance_{os.path.basename(name)}")
    module.__dict__["__nbl_call__"] = only
    module.__file__ = script_path(name)
    sys.modules[module.__name__] = module  # pickling a test's own classes finds them
    exec(code, module.__dict__)
    module.main()
    return reached


@dataclass
class Outcome:
    script: str
    call: str  # e.g. "test_gather #0"
    accelerate: str  # "pass", or the failure's first line
    nblaunch: str


def _launch(name: str, ported: bool, target: tuple[int, int] | None) -> tuple[str, dict[int, int]]:
    from nblaunch import RankFailedError, notebook_launcher
    from nblaunch.launch.errors import LaunchTimeoutError

    try:
        results = notebook_launcher(run_in_rank, args=(name, ported, target), num_processes=2,
                                    timeout=CALL_TIMEOUT_S, display="none")
        return "pass", results[0]
    except RankFailedError as error:
        return error.root_cause.reason.splitlines()[0][:300], {}
    except LaunchTimeoutError:
        return f"timed out after {CALL_TIMEOUT_S} s", {}


def _import_what_it_imports(name: str) -> None:
    """Import here what the script imports, so every launch's forked ranks inherit it."""
    with open(script_path(name)) as f:
        tree = ast.parse(f.read())
    for source in (tree, ast.parse(port(ast.unparse(tree)))):
        for node in source.body:
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in modules:
                try:
                    importlib.import_module(module)
                except Exception:
                    pass  # the launch will say what is missing


def conformance(scripts: tuple[str, ...] = SCRIPTS) -> list[Outcome]:
    """Every test call of every script, under Accelerate and ported to nblaunch."""
    outcomes = []
    for name in scripts:
        _import_what_it_imports(name)
        status, reached = _launch(name, False, None)  # which calls main() reaches, how often
        if status != "pass":
            outcomes.append(Outcome(name, "main() itself", status, _launch(name, True, None)[0]))
            continue
        order = _statement_names(name)
        seen: dict[str, int] = {}
        for index in sorted(reached):
            for iteration in range(reached[index]):
                seen[order[index]] = seen.get(order[index], -1) + 1
                call = f"{order[index]} #{seen[order[index]]}"  # the n-th call of that function
                accelerate_status, _ = _launch(name, False, (index, iteration))
                nblaunch_status, _ = _launch(name, True, (index, iteration))
                outcomes.append(Outcome(name, call, accelerate_status, nblaunch_status))
    return outcomes


def _statement_names(name: str) -> list[str]:
    with open(script_path(name)) as f:
        tree = ast.parse(f.read())
    own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} - {"main"}
    (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    names: list[str] = []

    class Collect(ast.NodeVisitor):
        def visit_Expr(self, node):
            call = node.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in own:
                names.append(call.func.id)

    Collect().visit(main)
    return names


def summary(outcomes: list[Outcome]) -> tuple[int, int]:
    """(calls that pass under nblaunch, calls that pass under Accelerate), among the latter."""
    under_accelerate = [o for o in outcomes if o.accelerate == "pass"]
    return sum(o.nblaunch == "pass" for o in under_accelerate), len(under_accelerate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", nargs="*", default=list(SCRIPTS), help="script names (default: all)")
    options = parser.parse_args()
    outcomes = conformance(tuple(options.scripts))
    print("| script | test call | Accelerate | nblaunch |\n|---|---|---|---|")
    for o in outcomes:
        print(f"| {o.script} | {o.call} | {o.accelerate} | {o.nblaunch} |")
    passed, total = summary(outcomes)
    print(f"\n{passed} of {total} test calls that pass under Accelerate pass under nblaunch")


if __name__ == "__main__":
    main()
