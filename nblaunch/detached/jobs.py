"""How the kernel starts a detached supervisor: :func:`start_supervisor` writes a job (any
object with ``run(folder, stop_requested)``: a launch's, ``launch/local_cluster.LaunchJob``; warm
ranks', ``warm/pool_job.PoolJob``) to a new private folder (:func:`new_job_folder`) and starts
``nblaunch.detached.daemon`` on it. A cluster that runs the supervisor elsewhere (a Slurm batch job)
writes the folder with :func:`new_job_folder` and starts ``nblaunch.detached.daemon --here`` there.
This folder knows nothing of what the jobs run.

Example::

    folder = start_supervisor(LaunchJob(request), kind="launch", function="train", num_processes=2)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import cloudpickle

from nblaunch.detached import store

__all__ = ["new_job_folder", "start_supervisor"]


def start_supervisor(job: Any, **state: Any) -> str:
    """Write ``job`` (an object with ``run(folder, stop_requested)``) to a new launch folder, start its supervisor
    outside this process's tree, and return the folder. ``state`` goes to ``state.json``."""
    folder = new_job_folder(job, **state)
    with open(os.path.join(folder, "supervisor.log"), "ab") as log:
        starter = subprocess.Popen([sys.executable, "-m", "nblaunch.detached.daemon", folder],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, close_fds=True)
    starter.wait()  # it forks the supervisor and exits at once
    return folder


def new_job_folder(job: Any, **state: Any) -> str:
    """A new launch folder holding ``job`` and where this kernel reads it from; ``state`` goes
    to ``state.json``. Nothing is started."""
    launch_id = uuid.uuid4().hex[:12]
    folder = store.new_launch_folder(launch_id)
    store.write_atomically(os.path.join(folder, "where.json"),
                           json.dumps({"cwd": os.getcwd(), "sys_path": sys.path}).encode())
    store.write_atomically(os.path.join(folder, "request.pkl"), cloudpickle.dumps(job))
    store.write_state(folder, id=launch_id, started=time.time(), status="starting", kernel_pid=os.getpid(), **state)
    return folder
