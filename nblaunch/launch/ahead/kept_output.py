"""What an import ahead writes, kept from the notebook: a warning or a banner printed as this
process imports ahead (``kernel_preload``) would land under a cell that did not ask for it
(``TqdmExperimentalWarning`` under a launch's return value).

While the body runs, ``sys.stdout`` and ``sys.stderr`` write what this thread writes (a warning
included: ``warnings`` writes to ``sys.stderr`` as it is shown) into the text kept, and what
other threads write where it went before. Nothing is dropped: ``nblaunch.warm_start()`` shows
what each package said.

Example::

    with kept_output() as said:
        importlib.import_module("tqdm.autonotebook")
    said.getvalue()    # 'TqdmExperimentalWarning: Using `tqdm.autonotebook.tqdm` ...'
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from typing import Iterator, TextIO


class _ThisThreadKept:
    """A stream that keeps one thread's writes and passes on every other thread's."""

    def __init__(self, shown: TextIO, kept: io.StringIO, thread: threading.Thread) -> None:
        self._shown, self._kept, self._thread = shown, kept, thread
        self.stands_in_for = shown  # a fork meanwhile finds the logging handlers that write to it

    def write(self, text: str) -> int:
        if threading.current_thread() is self._thread:
            return self._kept.write(text)
        return self._shown.write(text)

    def writelines(self, lines) -> None:  # noqa: ANN001  any iterable of str, as TextIO's
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if threading.current_thread() is not self._thread:
            self._shown.flush()

    def __getattr__(self, name: str):  # noqa: ANN204  the rest is the stream's it stands in for
        return getattr(self._shown, name)


@contextlib.contextmanager
def kept_output() -> Iterator[io.StringIO]:
    """Keep what this thread writes to ``sys.stdout``/``sys.stderr`` in the body (see the module)."""
    kept = io.StringIO()
    thread = threading.current_thread()
    before = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (_ThisThreadKept(stream, kept, thread) for stream in before)
    installed = sys.stdout, sys.stderr
    try:
        yield kept
    finally:
        # Put back only what is still ours: a stream someone set meanwhile is theirs.
        if sys.stdout is installed[0]:
            sys.stdout = before[0]
        if sys.stderr is installed[1]:
            sys.stderr = before[1]
