"""The supervisor of a detached job: ``python -m nblaunch.detached.daemon FOLDER``.

Started by the kernel, it forks once and the first process exits, so the supervisor is nobody's
child in the kernel's process tree and lives in a session of its own: a kernel's exit, restart or
SIGKILL does not reach it. It reads the job the kernel left in FOLDER (``request.pkl``: an object
with ``run(folder)``, :class:`~nblaunch.detached.jobs.LaunchJob` for a launch, a warm pool's job
for detached warm ranks) where the kernel would have read it (its folder and ``sys.path``), runs
it, and exits. What the job ends with is in FOLDER (``outcome.pkl``, ``state.json``). A SIGTERM before the job is under way is kept for it.

``python -m nblaunch.detached.daemon --here FOLDER`` runs the job in this process instead: a
Slurm batch job is the place the supervisor runs, and Slurm keeps it apart from any kernel.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from nblaunch import proctree
from nblaunch.detached import store

__all__ = ["main"]


def main(folder: str, here: bool = False) -> None:
    record = None if here else _become_nobodys_child()
    stop_requested = threading.Event()  # a cancel before the job is under way: it honours it then
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    store.write_state(folder, supervisor_pid=os.getpid(), supervisor_start=proctree.start_ticks(os.getpid()),
                      status="starting")
    if record is not None:
        os.write(record, b"x")
        os.close(record)
    try:
        job = _load_job(folder)
    except BaseException as error:  # nothing started: say why where result() looks
        store.finish(folder, "failed", ("error", error))
        raise
    job.run(folder, stop_requested)


def _become_nobodys_child() -> int:
    """Fork; the first process exits once the second has recorded itself (write to the returned
    pipe end), so the kernel's starter returns with the supervisor findable: a cancel() right
    after the launch call then finds it. The second leads a session of its own."""
    recorded, record = os.pipe()
    if os.fork():
        os.close(record)
        os.read(recorded, 1)
        os._exit(0)  # the kernel reaps this one at once; the supervisor is adopted by init
    os.close(recorded)
    os.setsid()
    return record


def _load_job(folder: str):
    """The kernel's job, read where the kernel would read it: its folder and its sys.path (a
    function defined in a module is pickled by name)."""
    with open(os.path.join(folder, "where.json"), encoding="utf-8") as file:
        where = json.load(file)
    os.chdir(where["cwd"])
    sys.path[:] = where["sys_path"]
    return store.read_job(folder)


if __name__ == "__main__":
    main(sys.argv[-1], here=sys.argv[1] == "--here")
