"""Frames in tracebacks and stacks, as a user wants to read them: which are their own code, and
where that was, named as the notebook names it (``Cell In[3], line 4``).

Used by the launcher (the headline of a failure, the line for a stopped rank) and by the ranks
(their tracebacks start at the user's function, not in nblaunch's code that called it).

Example::

    where("Traceback (most recent call last):\\n  File \\"train.py\\", line 9, in step\\n    loss.backward()\\n")
    # 'train.py, line 9, in step: loss.backward()'
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig

__all__ = ["cell_number", "first_frames", "is_launcher_code", "is_python_machinery", "is_users", "name_cells", "where"]

_PACKAGE = os.path.dirname(os.path.realpath(__file__))
_EXAMPLES = (os.path.join(_PACKAGE, "demo.py"),)  # the user's code when it runs
# Python itself and installed packages: not where a user looks for their bug.
_NOT_USER = tuple(os.path.realpath(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib", "platlib"))
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')


def is_launcher_code(path: str) -> bool:
    """A file of nblaunch's own (its demo excepted)."""
    path = os.path.realpath(path)
    return path.startswith(_PACKAGE + os.sep) and path not in _EXAMPLES


def is_python_machinery(path: str) -> bool:
    """Python's frozen modules (``<frozen runpy>``, which starts a script as ``__main__``)."""
    return path.startswith("<frozen ")


def is_users(path: str) -> bool:
    """Neither nblaunch's, nor Python's, nor an installed package's."""
    if is_launcher_code(path) or is_python_machinery(path):
        return False
    return not os.path.realpath(path).startswith(_NOT_USER)


def where(text: str, with_code: bool = True) -> str:
    """``place, in function: code`` of the innermost frame of the user's own code in a
    traceback or in the first thread of a stack dump (else of a library's, else its innermost
    frame); "" when the text holds no frame."""
    frames = first_frames(text)
    if not frames:
        return ""
    own = [f for f in frames if is_users(f[0])]
    not_ours = [f for f in frames if not is_launcher_code(f[0])]  # a library's, before nblaunch's own
    path, line, function, code = (own or not_ours or frames)[-1]
    return f"{_place(path, line)}, in {function}" + (f": {code}" if code and with_code else "")


def first_frames(text: str) -> list[tuple[str, int, str, str]]:
    """``(path, line, function, code)`` of each frame of a traceback, or of the first thread of a
    stack dump (a rank's main thread), outermost first."""
    first_thread = re.split(r"\n(?=Thread )", text.strip())[0].splitlines()
    frames = []
    for i, line in enumerate(first_thread):
        match = _FRAME.match(line)
        if match:
            following = first_thread[i + 1] if i + 1 < len(first_thread) else ""
            code = following.strip() if following.startswith("    ") and not _FRAME.match(following) else ""
            frames.append((match["path"], int(match["line"]), match["function"], code))
    return frames


def name_cells(text: str) -> str:
    """A traceback's ``File "/tmp/ipykernel_1/123.py", line 4`` as ``Cell In[3], line 4``,
    for the cells of this kernel (other frames as they are)."""

    def named(match: re.Match) -> str:
        cell = cell_number(match["path"])
        return match[0] if cell is None else f"{match['indent']}Cell In[{cell}], line {match['line']}"

    return re.sub(r'^(?P<indent>\s*)File "(?P<path>[^"]+)", line (?P<line>\d+)', named, text, flags=re.M)


def _place(path: str, line: int) -> str:
    cell = cell_number(path)
    if cell is not None:
        return f"Cell In[{cell}], line {line}"
    return f"{os.path.basename(path)}, line {line}"


_OLD_CELL = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>")  # IPython 7's cell file names (Colab)


def cell_number(path: str) -> int | None:
    """The execution count of the notebook cell that ``path`` names, in this kernel."""
    old = _OLD_CELL.fullmatch(path)
    if old:
        return int(old[1])
    ipython_module = sys.modules.get("IPython")
    shell = ipython_module.get_ipython() if ipython_module is not None else None
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if not names:
        return None
    number = names.get(path)
    return number if isinstance(number, int) else None
