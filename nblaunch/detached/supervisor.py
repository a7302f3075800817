"""The supervisor of a detached launch: ``python -m nblaunch.detached.supervisor FOLDER``.

Started by the kernel, it forks once and the first process exits, so the supervisor is nobody's
child in the kernel's process tree and lives in a session of its own: a kernel's exit, restart or
SIGKILL does not reach it. It runs the launch as an attached launch runs (the same ``Launch``:
right rank blamed, every rank stopped on failure, timeout, restarts, ranks that die with it),
with the journal as its display, writes the outcome, and exits.

Signals from this user (the only one who can send them): SIGTERM cancels, SIGUSR1 asks every rank
for its stack (the answers go to the journal and the logs).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import cloudpickle

from nblaunch import proctree
from nblaunch.detached import store
from nblaunch.detached.journal import JournalWriter
from nblaunch.homes import choose_home
from nblaunch.launch.handle import Launch

__all__ = ["main"]


def main(folder: str) -> None:
    if os.fork():
        os._exit(0)  # the kernel reaps this one at once; the supervisor is adopted by init
    os.setsid()
    with open(os.path.join(folder, "request.pkl"), "rb") as file:
        saved = file.read()
    store.write_state(folder, supervisor_pid=os.getpid(), supervisor_start=proctree.start_ticks(os.getpid()),
                      status="starting")
    try:
        request = _load_request(folder, saved)
        plan, home = choose_home(request, None)
        journal = JournalWriter(os.path.join(folder, "journal"))
        launch = Launch(plan, request.function, request.args, request.timeout, journal, home=home)
    except BaseException as error:  # nothing started: say why where result() looks
        _finish(folder, "failed", ("error", error))
        raise
    store.write_state(folder, log_dir=launch.log_dir, status="running")
    signal.signal(signal.SIGTERM, lambda *_: launch.cancel())
    signal.signal(signal.SIGUSR1, lambda *_: launch.request_stacks())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no terminal: an interrupt is not this user's wish
    launch.start(stop_at_exit=False)
    try:  # the main thread's wait is interrupted by the signals, whose handlers run here
        outcome = ("ok", launch.result())
    except BaseException as error:
        outcome = ("error", error)
    _finish(folder, launch.status, outcome)


def _load_request(folder: str, saved: bytes):
    """The kernel's LaunchRequest, read where the kernel would read it: its folder and its
    sys.path (a function defined in a module is pickled by name)."""
    with open(os.path.join(folder, "where.json"), encoding="utf-8") as file:
        where = json.load(file)
    os.chdir(where["cwd"])
    sys.path[:] = where["sys_path"]
    return cloudpickle.loads(saved)


def _finish(folder: str, status: str, outcome: tuple) -> None:
    try:
        data = cloudpickle.dumps(outcome)
    except Exception as error:  # results that cannot be pickled: say so instead of losing the end
        data = cloudpickle.dumps(("error", RuntimeError(f"the launch ended ({status}) but its outcome could not "
                                                        f"be kept: {error!r}")))
    store.write_atomically(os.path.join(folder, "outcome.pkl"), data)
    store.write_state(folder, status=status, ended=time.time())


if __name__ == "__main__":
    main(sys.argv[1])
