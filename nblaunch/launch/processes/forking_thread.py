"""The one thread every forked rank comes from.

GNU OpenMP (libgomp, which CPU builds of torch use for intra-op parallelism) keeps a pool of
worker threads for each thread that has run a parallel region. A process forked from such a
thread inherits the pool's bookkeeping but not its threads, and its first parallel region with
more than one thread waits for them forever. The kernel's main thread is where the notebook's
torch ops ran, so ranks forked from it hung in their first big op as soon as they had more than
one intra-op thread (any machine with more cores than ranks). This thread runs nothing but
forks, so it never has a pool, and the children start OpenMP afresh.

It also lives as long as the process, which PR_SET_PDEATHSIG wants: a rank's death signal fires
when the thread that forked it ends.

Example::

    pids = run_on_forking_thread(fork_every_rank, undo=kill_those_forked)
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, TypeVar

from nblaunch.per_process import per_process

T = TypeVar("T")



def run_on_forking_thread(work: Callable[[], T], undo: Callable[[T], None]) -> T:
    """``work()``, run on the forking thread; its result, or its exception, comes back here.

    An interrupt while waiting cannot stop a fork half-way: the wait goes on, ``undo(result)``
    takes back what was made (a process nobody would own), and the interrupt is raised then.
    """
    done: concurrent.futures.Future = concurrent.futures.Future()
    _queue().put((work, done))
    interrupted = False
    while True:
        try:
            result = done.result()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        undo(result)
        raise KeyboardInterrupt
    return result


def _new_queue() -> queue.SimpleQueue:
    # In a fork, the child is the forking thread itself, busy for good in the rank's code: a
    # launch made inside the rank gets a forking thread of its own (per_process forgets this one).
    requests: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_serve, args=(requests,), name="nblaunch-forks", daemon=True).start()
    return requests


_queue = per_process(_new_queue)


def _serve(requests: queue.SimpleQueue) -> None:
    while True:
        work, done = requests.get()
        try:
            done.set_result(work())
        except BaseException as error:
            done.set_exception(error)
