"""What a launch's ranks will import, known before they start.

Two sources, for one list that the process the ranks are forked from imports first (``preload``):

- **The code.** The import statements of the launched function and of the user's own code it
  reaches (functions and classes of the notebook or of the user's modules, through its globals,
  closures and arguments), read from the bytecode, on the paths every run takes (an import under
  an ``if`` may never run: a library the user's code imports only sometimes is learned instead); the modules of the libraries' objects it
  names (``load_digits`` is ``sklearn.datasets._base``'s); and ``torch._dynamo`` where the code
  trains (it names torch's optimizers or ``torch.compile``), which building an optimizer imports
  (a trainer that builds its own, as ``transformers.Trainer`` does, is learned from its ranks). Nothing is run or imported to find them: a module's lazy attributes are not
  asked for.
- **What earlier ranks said.** At its end each rank tells which installed libraries it imported
  (``wire.IMPORTED``): the next launch of the same function imports them too (a library's lazy
  imports, ``__import__`` of a name the code computes).

Only installed libraries count (``machine/installed``), and nblaunch's own modules: never the
standard library, never code of the user's (it may change between two launches).

Example::

    wanted(train, ())      # [("sklearn.datasets", ("load_digits",)), ("torch._dynamo", ()), ...]
    reported(train, ["sklearn", "sklearn.utils", ...])   # what its ranks said at their end
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import os
import sys
import threading
import types

from nblaunch.machine.installed import library_folders, top_level
from nblaunch.per_process import per_process

Wanted = tuple[str, tuple[str, ...]]  # a module, and the names a `from ... import` takes from it
TRAINS = "torch._dynamo"  # what building a first optimizer imports: about a second per process
# Names that mean the code builds an optimizer: torch.optim's (torch.compile is found by what the
# name is). Not a trainer's class: making an Accelerator imports no torch._dynamo by itself.
_TRAINING_NAMES = frozenset({"optim", "Optimizer"})
_MOST_CODE = 200  # code objects read per launch: a notebook's helpers, not a library's depths
# The notebook's own machinery, in the kernel but no rank's business: never imported for the
# ranks (a rank forked from a kernel may import some of it as it writes output).
_KERNEL_MACHINERY = frozenset({
    "IPython", "ipykernel", "ipykernel_launcher", "jupyter_client", "jupyter_core", "zmq", "tornado", "traitlets",
    "comm", "debugpy", "pydevd", "_pydevd_bundle", "_pydev_bundle", "_pydevd_frame_eval", "pydev_ipython",
    "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "prompt_toolkit", "jedi", "parso", "pexpect",
    "ptyprocess", "matplotlib_inline", "nest_asyncio", "stack_data", "executing", "asttokens", "pure_eval",
    "wcwidth", "pickleshare", "backcall", "colab_kernel_launcher", "nbformat", "nbclient", "ipyparallel",
    "pytest", "_pytest", "pluggy", "py", "google",
})


def wanted(function: object, args: tuple = ()) -> list[Wanted]:
    """What the ranks of a launch of ``function(*args)`` will import, in order (see the module).
    Never raises: code it cannot read (an object that answers every attribute, say) adds nothing."""
    places = _Places()
    reader = _CodeReader(places)
    try:
        reader.read(function, args)
    except Exception:  # noqa: BLE001  what was read so far stands; the ranks import the rest themselves
        pass
    listed: dict[str, tuple[str, ...]] = {}
    for name, names in reader.modules:
        listed[name] = tuple(dict.fromkeys(listed.get(name, ()) + names))
    if reader.trains:
        listed.setdefault(TRAINS, ())
    for name in _reports().of(_key(function)):
        listed.setdefault(name, ())
    return [(name, names) for name, names in listed.items() if places.importable(name)]


def reported(function: object, names: list[str]) -> None:
    """What the ranks of a launch of ``function`` said they imported (installed modules, in order)."""
    places = _Places()
    _reports().add(_key(function), [n for n in names if places.importable(n)])


def _key(function: object) -> str:
    """Which launches count as the same function: its module and qualified name."""
    while isinstance(function, functools.partial):
        function = function.func
    qualname = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', None)}.{qualname}"


class _Reports:
    """What ranks said they imported, by function (see ``reported``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_function: dict[str, dict[str, None]] = {}

    def add(self, key: str, names: list[str]) -> None:
        with self._lock:
            self._by_function.setdefault(key, {}).update(dict.fromkeys(names))

    def of(self, key: str) -> list[str]:
        with self._lock:
            return list(self._by_function.get(key, {}))


_reports = per_process(_Reports)  # a rank's own launches learn for themselves


class _Places:
    """Where each top-level package lives, asked once per launch (a package installed since the
    last launch is seen)."""

    def __init__(self) -> None:
        self._installed: dict[str, bool] = {}

    def importable(self, name: str) -> bool:
        """Whether ``name`` may be imported for the ranks: an installed library's module, or
        nblaunch's own, never the notebook's machinery."""
        top = top_level(name)
        if top in _KERNEL_MACHINERY or top.startswith("_"):
            return False
        return top == "nblaunch" or self.installed(top)

    def users(self, value: object) -> bool:
        """Whether ``value`` (a function, a class) is code of the user's: neither an installed
        library's, nor the standard library's, nor nblaunch's."""
        module = getattr(value, "__module__", None)
        if not isinstance(module, str):
            return False
        if module == "__main__":
            return True
        top = top_level(module)
        return top != "nblaunch" and top not in sys.stdlib_module_names and not self.installed(top)

    def installed(self, package: str) -> bool:
        """Whether ``package`` (loaded or not) sits right in a site-packages folder."""
        if package not in self._installed:
            self._installed[package] = package not in sys.stdlib_module_names and _in_site_packages(package)
        return self._installed[package]


def _in_site_packages(package: str) -> bool:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    origin = spec.origin if isinstance(spec.origin, str) and os.path.isabs(spec.origin) else None
    locations = list(spec.submodule_search_locations or [])
    if origin is not None:
        folder = os.path.dirname(os.path.realpath(origin))
        if locations:  # a package: name/__init__.py
            folder = os.path.dirname(folder)
    elif locations:  # a namespace package
        folder = os.path.dirname(os.path.realpath(locations[0]))
    else:
        return False
    return folder + os.sep in library_folders()


class _CodeReader:
    """Reads code for what it imports (see the module); never runs or imports anything."""

    def __init__(self, places: _Places) -> None:
        self.modules: list[Wanted] = []
        self.trains = False
        self._places = places
        self._seen: set[int] = set()
        self._read = 0
        self._todo: list[object] = []

    def read(self, function: object, args: tuple) -> None:
        self._todo = [function, *args]
        while self._todo and self._read < _MOST_CODE:
            try:
                self._follow(self._todo.pop(0))
            except Exception:  # noqa: BLE001  a value that resists reading (a proxy, a mock) is skipped
                continue

    def _follow(self, value: object) -> None:
        """Read ``value`` if it is code of the user's; note the library it comes from otherwise."""
        if id(value) in self._seen:
            return
        if isinstance(value, (types.FunctionType, type, types.ModuleType)):
            self._seen.add(id(value))
        if isinstance(value, functools.partial):
            self._todo += [value.func, *value.args, *value.keywords.values()]
        elif isinstance(value, (types.MethodType, staticmethod, classmethod)):
            self._follow(value.__func__)
        elif isinstance(value, types.ModuleType):
            self._library(value.__name__)
        elif isinstance(value, types.FunctionType):
            if self._places.users(value):
                self._read_function(value)
            else:
                self._library(getattr(value, "__module__", None))
                self.trains |= value is getattr(sys.modules.get("torch"), "compile", None)
        elif isinstance(value, type):
            if self._places.users(value):
                self._todo += [v for v in vars(value).values()
                               if isinstance(v, (types.FunctionType, staticmethod, classmethod, property))]
            else:
                self._library(value.__module__)
                self.trains |= _optimizer(value)
        elif isinstance(value, property):
            self._todo += [f for f in (value.fget, value.fset) if f is not None]
        elif callable(value) and self._places.users(type(value)):
            self._follow(type(value))  # an object of the user's class, called as the function

    def _library(self, module: object) -> None:
        """A library's object the code names: its module is imported where the function is
        unpickled, so ranks of the launch server find it there."""
        if isinstance(module, str) and module in sys.modules:
            self.modules.append((module, ()))

    def _read_function(self, function: types.FunctionType) -> None:
        cells = {}
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
            try:
                cells[name] = cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue
        self._todo += list(cells.values())
        self._read_code(function.__code__, function.__globals__, cells)

    def _read_code(self, code: types.CodeType, globals_: dict, cells: dict) -> None:
        if id(code) in self._seen or self._read >= _MOST_CODE:
            return
        self._seen.add(id(code))
        self._read += 1
        self.trains |= bool(_TRAINING_NAMES & set(code.co_names))
        builtins = globals_.get("__builtins__", {})
        aliases: dict[str, str] = {}  # local names an import statement of this code bound: what they name
        statement = _ImportStatement()
        held: object = None  # what the instructions so far point at (a chain of attributes)
        before: list[tuple[str, object]] = []  # the two instructions before this one
        instructions = list(dis.get_instructions(code))
        maybe = _conditional(instructions)
        for instruction in instructions:
            op, arg = instruction.opname, instruction.argval
            if op == "IMPORT_NAME":
                loaded = [o for o, _ in before] == ["LOAD_CONST", "LOAD_CONST"]
                level, names = (before[0][1], before[1][1]) if loaded else (0, None)
                if level == 0 and isinstance(arg, str):
                    if instruction.offset not in maybe:
                        self.modules.append((arg, tuple(names or ())))
                    statement.begin(arg, names)
                held = None
            elif statement.going and op == "IMPORT_FROM":
                statement.take(arg)
            elif statement.going and op.startswith("STORE_"):
                aliases[arg] = statement.bound()
            elif statement.going and op in ("POP_TOP", "SWAP", "ROT_TWO", "COPY"):
                pass  # between the names of one statement
            else:
                statement.end()
                if op in ("LOAD_GLOBAL", "LOAD_NAME"):
                    held = globals_.get(arg, _builtin(builtins, arg))
                elif op in ("LOAD_DEREF", "LOAD_FAST", "LOAD_FAST_CHECK"):
                    held = cells[arg] if arg in cells else _module_or_name(aliases.get(arg))
                elif op in ("LOAD_ATTR", "LOAD_METHOD") and held is not None:
                    held = _static_attribute(held, arg)
                else:
                    held = None
                if held is not None and not isinstance(held, str) and instruction.offset not in maybe:
                    self._follow(held)
                if op == "LOAD_CONST" and isinstance(arg, types.CodeType):  # a nested function, class body
                    self._read_code(arg, globals_, {})
            before = (before + [(op, arg)])[-2:]


def _conditional(instructions: list[dis.Instruction]) -> set[int]:
    """The offsets of the instructions that run only on some paths: an ``if``'s body (past a
    forward conditional jump, up to its target) and its ``else`` (past the forward jump over it),
    an ``except`` clause. A loop's body counts as run (it usually is), and so does what follows an
    ``if`` that returns: the code after it is the function's usual path."""
    regions = [(i.offset, i.argval) for i in instructions
               if isinstance(i.argval, int) and i.argval > i.offset
               and (("JUMP" in i.opname and "IF" in i.opname) or i.opname == "JUMP_FORWARD")]
    return {i.offset for i in instructions if any(start < i.offset < end for start, end in regions)}


class _ImportStatement:
    """The names one import statement binds, as its instructions go: ``import a.b`` binds ``a``;
    ``import a.b as c`` binds ``c`` to ``a.b`` (IMPORT_FROM b after IMPORT_NAME a.b); ``from a
    import b, c`` binds each name to ``a.<name>``."""

    def __init__(self) -> None:
        self.going = False
        self._base, self._path, self._from = "", [], False

    def begin(self, module: str, names: object) -> None:
        self.going, self._from = True, bool(names)
        self._base, self._path = (module, []) if names else (top_level(module), [])

    def take(self, name: str) -> None:
        self._path = [name] if self._from else self._path + [name]

    def bound(self) -> str:
        bound = ".".join([self._base, *self._path])
        self.going = self._from  # `import x [as y]` binds one name
        return bound

    def end(self) -> None:
        self.going = False


def _builtin(builtins: object, name: str) -> object:
    return builtins.get(name) if isinstance(builtins, dict) else getattr(builtins, name, None)


def _module_or_name(dotted: str | None) -> object:
    """The loaded module (or attribute of one) ``dotted`` names; the name itself if not loaded."""
    if dotted is None:
        return None
    module = sys.modules.get(dotted)
    if module is not None:
        return module
    head, _, attribute = dotted.rpartition(".")
    parent = sys.modules.get(head)
    return _static_attribute(parent, attribute) if parent is not None else dotted


def _static_attribute(value: object, name: str) -> object:
    """``value.name`` as stored, never computed (a lazy module's ``__getattr__`` imports)."""
    if isinstance(value, str):  # a module not loaded yet: its submodule or attribute, by name
        return f"{value}.{name}"
    if isinstance(value, types.ModuleType):
        found = vars(value).get(name)
        return found if found is not None else sys.modules.get(f"{value.__name__}.{name}")
    if isinstance(value, type):
        for klass in value.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
    return None


def _optimizer(klass: type) -> bool:
    base = getattr(sys.modules.get("torch.optim"), "Optimizer", None)
    return isinstance(base, type) and issubclass(klass, base)
