"""``%%distributed``: a cell runs on every rank of a warm pool, in a namespace each rank keeps.

``%load_ext nblaunch`` registers it. The first ``%%distributed`` cell starts the pool (``-n`` with
another size, or ``--spawn``, starts a new one); later cells run on the same ranks, with the
same process group and everything earlier cells defined there. Names a cell uses from the
notebook (functions, small data, modules) are sent along, unless a rank defined them itself
in an earlier cell. The cell's value is its last expression, one per rank.

Example::

    %load_ext nblaunch

    %%distributed -n 2
    from nblaunch import Accelerator
    accelerator = Accelerator()
    accelerator.process_index        # -> [0, 1]

    %distributed status
    %distributed stop

``--ray --nodes 2`` keeps the ranks on two nodes of the Ray cluster the notebook is connected to
(``-n`` ranks on each); ``--slurm`` on the nodes of the kernel's Slurm allocation (every node, or
``--nodes``). ``--detach`` keeps them under a supervisor of their own: after a kernel
restart, the first ``%%distributed --detach`` cell reattaches to them (and says so), with
everything earlier cells defined there; a cell that asks for other ranks is refused, never
allowed to close them.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import linecache
import shlex
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class

from nblaunch.display import DISPLAY_CHOICES
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning.request import check_stall_after
from nblaunch.warm.detached_pool import DetachedWarmRanks
from nblaunch.warm.ranks import WarmRanks
from nblaunch.worker.calls import namespace_names, run_code

# The notebook's own machinery: never sent to the ranks.
_NOT_SENT = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_ih", "_oh", "_dh"}


_USAGE = ("%%distributed [-n N] [--spawn] [--cpu] [--timeout S] [--stall-after S] [--ray | --slurm] [--nodes K] "
          "[--detach] [--rank R | --ranks R,R...] [--display auto|widget|text|none]")


def cell_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%%distributed", add_help=False, exit_on_error=False)
    parser.add_argument("-n", "--num-processes", type=int, default=None)
    # None where not given: a cell that leaves an option out runs on the ranks that are up.
    parser.add_argument("--spawn", action="store_const", const=True, default=None)
    parser.add_argument("--cpu", action="store_const", const=True, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--ray", action="store_true")
    parser.add_argument("--slurm", action="store_true")
    parser.add_argument("--detach", action="store_true")
    parser.add_argument("--rank", "--ranks", dest="ranks", type=_rank_list, default=None)
    parser.add_argument("--stall-after", dest="stall_after", type=float, default=None)
    parser.add_argument("--display", choices=DISPLAY_CHOICES, default=None)
    return parser


def _rank_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rank takes a rank or ranks separated by commas (0 or 0,1), got {text!r}")


@magics_class
class DistributedMagics(Magics):
    """``%%distributed`` and ``%distributed status|stop``."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.pool: WarmRanks | None = None
        self._shape: tuple = ()  # (spawn, nodes, cluster, cpu) the pool was made with
        self._defined_in_ranks: set[str] = set()  # names the ranks' cells assigned
        self._cells = 0

    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        __tracebackhide__ = True
        if cell is None:
            return self._command(line.strip())
        try:
            options = cell_parser().parse_args(shlex.split(line))
        except (argparse.ArgumentError, SystemExit, ValueError) as error:
            raise LaunchConfigError(f"{_USAGE}: {error}") from None
        if options.ray and options.slurm:
            raise LaunchConfigError(f"{_USAGE}: --ray or --slurm, not both")
        filename = f"<distributed cell {self._cells + 1}>"
        compile(cell, filename, "exec")  # a typo is reported here: it must not cost the ranks their state
        # Its lines, here as in the ranks: a traceback and %debug's `ll` show them.
        linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
        if options.stall_after is not None:
            check_stall_after(options.stall_after)
        cluster = "ray" if options.ray else "slurm" if options.slurm else None
        if options.ranks is not None:
            pool = self._pool_for_some_ranks(options)
        else:
            pool = self._pool_for(options.num_processes, (options.spawn, options.nodes, cluster, options.cpu),
                                  options.detach, options.stall_after)
        self._cells += 1
        sent = self._names_to_send(cell)
        try:
            results = pool.run(run_code, cell, sent, filename, timeout=options.timeout, display=options.display,
                               **({"ranks": options.ranks} if options.ranks is not None else {}))
        except BaseException:
            if isinstance(pool, DetachedWarmRanks):  # its ranks may have been replaced: send names again
                self._defined_in_ranks = set()
            raise
        self._defined_in_ranks |= assigned_names(cell)
        return None if all(r is None for r in results) else results

    def _pool_for_some_ranks(self, options: argparse.Namespace) -> WarmRanks:
        """A ``--rank`` cell looks at the ranks of the pool that is up: it never starts one."""
        if isinstance(self.pool, DetachedWarmRanks):
            raise LaunchConfigError("--rank does not reach detached warm ranks yet: run the cell on every rank, "
                                    "with `if dist.get_rank() == 0:` around what only rank 0 should do")
        if self.pool is None or not self.pool.alive:
            raise LaunchConfigError("--rank runs a cell on some ranks of the warm ranks that are up, and none are: "
                                    "start them first with a %%distributed cell that runs on every rank")
        if options.num_processes is not None or options.detach or options.spawn or options.nodes is not None:
            raise LaunchConfigError("--rank runs on the warm ranks that are up: leave -n/--spawn/--nodes/--detach out")
        self.pool.checked_ranks(options.ranks)  # the valid range, before anything is sent
        return self.pool

    def _pool_for(self, num_processes: int | None, shape: tuple, detach: bool,
                  stall_after: float | None = None) -> WarmRanks:
        """The pool for this cell: the current one, unless the cell asks for another size or kind;
        with ``--detach`` in a kernel without one, this user's detached warm ranks if they are up."""
        if self.pool is None and detach:
            self._reattach(num_processes, shape)
        pool = self.pool
        # What the cell leaves out is what the ranks that are up have (or the defaults).
        shape = tuple(asked if asked is not None else had
                      for asked, had in zip(shape, self._shape if pool is not None else (False, None, None, False)))
        wanted = num_processes if num_processes is not None else (pool.num_processes if pool else None)
        changed = pool is not None and (wanted != pool.num_processes or shape != self._shape)
        if pool is not None and not changed and stall_after is not None and stall_after != pool.request.stall_after:
            print(f"nblaunch: --stall-after applies when the ranks start; these keep {pool.request.stall_after}")
        if isinstance(pool, DetachedWarmRanks) and changed:  # hours of state: never closed by a side effect
            raise LaunchConfigError(
                f"the detached warm ranks {pool.launch_id} have {pool.num_processes} ranks, started "
                f"{_describe(self._shape)}: run the cell without options that change them, or close them first "
                "with %distributed stop")
        if changed or (detach and pool is not None and not isinstance(pool, DetachedWarmRanks)):
            if changed and pool.alive:  # never silently: what the ranks held goes with them
                print(f"nblaunch: this cell asks for {wanted} ranks {_describe(shape)}; the warm ranks that are up "
                      f"have {pool.num_processes}, {_describe(self._shape)}: closing them and starting new ones "
                      "(what they held is gone)")
            pool.close()
            pool = None
        if pool is None:
            spawn, nodes, cluster, cpu = shape
            pool = self.pool = WarmRanks(num_processes=wanted, start_method="spawn" if spawn else None,
                                         num_nodes=nodes, cluster=cluster, cpu=cpu, detach=detach,
                                         **({"stall_after": stall_after} if stall_after is not None else {}))
            self._shape = shape
            self._defined_in_ranks = set()
        elif not pool.alive:
            self._defined_in_ranks = set()  # a fresh pool knows nothing of the old one's names
        return pool

    def _reattach(self, num_processes: int | None, shape: tuple) -> None:
        """Find this user's detached warm ranks (the kernel restarted since a ``--detach`` cell),
        say so, and learn which names their cells defined. Options the cell gives must match."""
        try:
            pool = WarmRanks.attach()
        except LookupError:
            return
        except (OSError, ValueError) as error:  # the state folder unreadable: start fresh ranks instead
            print(f"nblaunch: could not look for detached warm ranks ({error}); starting new ones")
            return
        spawn, nodes, cluster, cpu = shape
        pool_shape = _shape_of(pool.request)
        asked_otherwise = ((num_processes is not None and num_processes != pool.num_processes)
                           or (spawn and not pool_shape[0]) or (cpu and not pool_shape[3]))
        if asked_otherwise:
            raise LaunchConfigError(
                f"this user's detached warm ranks {pool.launch_id} have {pool.num_processes} ranks, started "
                f"{_describe(pool_shape)}, not what this cell asks: leave -n/--spawn/--cpu out to reattach to them, "
                f"or stop them first (WarmRanks.attach().close(), or nblaunch stop {pool.launch_id})")
        print(f"nblaunch: reattached to the detached warm ranks {pool.launch_id} ({pool.num_processes} processes): "
              "what earlier cells defined there is still there")
        self.pool, self._shape = pool, pool_shape
        self._defined_in_ranks = set(pool.run(namespace_names, display="none")[0])

    def _names_to_send(self, cell: str) -> dict[str, Any]:
        user = self.shell.user_ns
        hidden = getattr(self.shell, "user_ns_hidden", {})
        sent = {}
        for name in used_names(cell):
            if name in self._defined_in_ranks or name in _NOT_SENT or name in hidden or name not in user:
                continue
            if hasattr(builtins, name) and getattr(builtins, name) is user[name]:
                continue
            sent[name] = user[name]
        return sent

    def _command(self, command: str) -> str | None:
        if command == "status":
            return repr(self.pool) if self.pool is not None else "no warm ranks yet: the first %%distributed cell starts them"
        if command == "stop":
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            return None
        raise LaunchConfigError(f"%distributed {command}: use '%distributed status' or '%distributed stop', "
                                "or %%distributed as a cell magic")


def _shape_of(request: Any) -> tuple:
    """What a cell's options say of a pool's ``LaunchRequest``: (spawn, nodes, cluster, cpu)."""
    return (request.start_method == "spawn", request.num_nodes, request.cluster, request.cpu)


def _describe(shape: tuple) -> str:
    spawn, nodes, cluster, cpu = shape
    parts = ["by spawn" if spawn else "by fork", "on the CPU" if cpu else "on this machine's devices"]
    where = f"on {nodes} nodes" if nodes is not None else "on every node"
    return ", ".join(parts + ([f"{where} of cluster={cluster!r}"] if cluster is not None else []))


def used_names(source: str) -> set[str]:
    """Every name the code reads (a syntax error is left for the ranks to report)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def assigned_names(source: str) -> set[str]:
    """Names the code binds in the rank's namespace: top-level assignments, defs, classes,
    imports, loop and with targets; not the names local to a function or class body."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            return  # its body is a scope of its own
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(DistributedMagics(ipython))
