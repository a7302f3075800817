"""What the supervisor of detached warm ranks runs: an ordinary ``WarmRanks`` serving the calls
kernels send it, one at a time.

Example (what ``WarmRanks(detach=True)`` hands the supervisor)::

    DetachedWarmRanks.start(PoolJob(request, WarmRanks.from_request), num_processes, display)
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import traceback
from typing import Any, Callable

from nblaunch.detached import call_socket, store
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.warm.detached_pool import Relay


@dataclasses.dataclass
class PoolJob:
    """What the supervisor of detached warm ranks runs: an ordinary WarmRanks, and the calls
    kernels send it one at a time (``nblaunch.detached.call_socket``), each shown in the calling
    kernel's cell. A caller is told "ready" when its turn comes, so one that waits (another
    kernel's call runs) and gives up is never served. A kernel that goes away mid-call leaves the
    call running; a call that cannot be read here is refused; neither ends the ranks."""

    request: LaunchRequest  # the pool's, as WarmRanks made it in the kernel
    make_pool: Callable[[LaunchRequest], Any]  # ``WarmRanks.from_request`` (this module is below it)

    def run(self, folder: str, stop_requested: threading.Event) -> None:
        pool = self.make_pool(self.request)
        server = call_socket.listen(os.path.basename(folder))
        store.write_state(folder, status="running")
        signal.signal(signal.SIGTERM, lambda *_: self._stop(pool, folder))
        if stop_requested.is_set():
            self._stop(pool, folder)
        while True:
            try:
                connection = call_socket.accept(server)
                if connection is None:
                    continue
                with connection:
                    call_socket.send(connection, ("ready",))
                    if self._serve(pool, connection) == "closed":
                        store.finish(folder, "done", ("ok", None))  # before the answer: the caller sees it ended
                        call_socket.send(connection, ("closed",))
                        return
            except (KeyboardInterrupt, call_socket.ChannelClosed):
                continue  # an interrupt for a call already over, or a kernel gone: wait for the next
            except Exception:  # a bug of ours must not end what the ranks hold: logged, then the next caller
                traceback.print_exc()

    @staticmethod
    def _serve(pool: Any, connection: Any) -> str:
        try:
            request = call_socket.receive(connection)
        except call_socket.ChannelUnreadable as error:
            call_socket.send(connection, ("raised", LaunchConfigError(
                f"the detached warm ranks could not read this call ({error}): they run with the folder and "
                "sys.path of the kernel that started them; define the function in the notebook, or put its "
                "module where that kernel would find it")))
            return "served"
        if request[0] == "close":
            pool.close()
            return "closed"
        _, function, args, timeout = request
        relay = Relay(connection)
        try:
            outcome = ("done", pool.run(function, *args, timeout=timeout, display=relay))
        except BaseException as error:  # the pool's own errors: a rank failed, a timeout, an interrupt
            outcome = ("raised", error)
        if relay.connected:
            call_socket.send(connection, outcome)
        return "served"

    @staticmethod
    def _stop(pool: Any, folder: str) -> None:
        pool.close()
        store.finish(folder, "cancelled", ("ok", None))
        os._exit(0)
