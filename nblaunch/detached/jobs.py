"""What a detached supervisor runs, and how the kernel starts one: :func:`start_supervisor`
writes a job to a new private folder and starts ``nblaunch.detached.supervisor`` on it;
:class:`LaunchJob` is a detached launch (warm pools bring their own job, ``nblaunch.warm``).

Example::

    folder = start_supervisor(LaunchJob(request), kind="launch", function="train", num_processes=2)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import cloudpickle

from nblaunch.detached import store
from nblaunch.detached.journal import JournalWriter
from nblaunch.homes import choose_home
from nblaunch.launch.handle import Launch
from nblaunch.launch.planning.plan import LaunchRequest

__all__ = ["start_supervisor", "LaunchJob"]


def start_supervisor(job: Any, **state: Any) -> str:
    """Write ``job`` (an object with ``run(folder, stop_requested)``) to a new launch folder, start its supervisor
    outside this process's tree, and return the folder. ``state`` goes to ``state.json``."""
    launch_id = uuid.uuid4().hex[:12]
    folder = store.new_launch_folder(launch_id)
    store.write_atomically(os.path.join(folder, "where.json"),
                           json.dumps({"cwd": os.getcwd(), "sys_path": sys.path}).encode())
    store.write_atomically(os.path.join(folder, "request.pkl"), cloudpickle.dumps(job))
    store.write_state(folder, id=launch_id, started=time.time(), status="starting", kernel_pid=os.getpid(), **state)
    with open(os.path.join(folder, "supervisor.log"), "ab") as log:
        starter = subprocess.Popen([sys.executable, "-m", "nblaunch.detached.supervisor", folder],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, close_fds=True)
    starter.wait()  # it forks the supervisor and exits at once
    return folder


@dataclass
class LaunchJob:
    """A launch run by a supervisor: the same ``Launch`` as an attached one, the journal as its
    display. SIGTERM cancels it, SIGUSR1 asks every rank for its stack."""

    request: LaunchRequest

    def run(self, folder: str, stop_requested: threading.Event) -> None:
        try:
            plan, home = choose_home(self.request, None)
            journal = JournalWriter(os.path.join(folder, "journal"))
            launch = Launch(plan, self.request.function, self.request.args, self.request.timeout, journal, home=home)
        except BaseException as error:
            store.finish(folder, "failed", ("error", error))
            raise
        store.write_state(folder, log_dir=launch.log_dir, status="running")
        signal.signal(signal.SIGTERM, lambda *_: launch.cancel())
        signal.signal(signal.SIGUSR1, lambda *_: launch.request_stacks())
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no terminal: an interrupt is not this user's wish
        if stop_requested.is_set():  # cancelled while it was being set up
            launch.cancel()
        launch.start(stop_at_exit=False)
        try:  # the main thread's wait is interrupted by the signals, whose handlers run here
            outcome = ("ok", launch.result())
        except BaseException as error:
            outcome = ("error", error)
        store.finish(folder, launch.status, outcome)
