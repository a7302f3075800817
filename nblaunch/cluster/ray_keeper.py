"""Detached launches on a Ray cluster: ``notebook_launcher(..., cluster="ray", detach=True)``.

A detached Ray actor, :class:`LaunchKeeper`, in nblaunch's namespace ``nblaunch-detached``,
runs the launch as a driver would (the same ``Launch`` with ``RayCluster``: a placement group, an
agent per node, the agents owned by the keeper, so a driver's exit does not reach them) and keeps
its events and outcome. :class:`KeptOnRay` is its place for
:class:`~nblaunch.detached.detached_launch.DetachedLaunch`: any driver connected to the cluster lists it,
watches it, collects its outcome (the keeper then leaves) or cancels it. A Ray cluster has no
users: whoever can connect to it can see its launches.

Example::

    place = RayCluster(request).keep()        # in the kernel: start_on_ray, returns at once
    kept_on_ray()                          # from any driver connected to the cluster
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import threading
import time
import uuid
from typing import Any

import cloudpickle

from nblaunch.cluster import ray_placement
from nblaunch.events import Event
from nblaunch.launch.handle import Launch
from nblaunch.launch.planning.request import LaunchRequest

__all__ = ["LaunchKeeper", "KeptOnRay", "start_on_ray", "kept_on_ray", "NAMESPACE"]

NAMESPACE = "nblaunch-detached"
_FIRST_KEPT = 500  # the launch's start, kept whatever follows
_LAST_KEPT = 20000  # and its recent past (every rank's whole output is in its log on its node)
_KEEPER_CONCURRENCY = 8  # watchers' long polls, a cancel, a stack request at once


class LaunchKeeper:
    """Runs one launch for whoever connects later. Used as a detached Ray actor (``start_on_ray``)."""

    def __init__(self, launch_id: str, packed: bytes, driver_path: list[str], info: dict[str, Any]) -> None:
        sys.path[:0] = [p for p in driver_path if p not in sys.path]  # the driver's modules, by name
        self._info = dict(info, id=launch_id, status="starting", started=time.time())
        self._first: list[bytes] = []  # events 0 .. _FIRST_KEPT - 1
        self._rest: list[bytes] = []  # events _rest_start .. (older ones dropped)
        self._rest_start = _FIRST_KEPT
        self._changed = threading.Condition()
        self._outcome: bytes | None = None
        self._launch: Any = None
        threading.Thread(target=self._run, args=(packed,), daemon=True, name="nblaunch-keeper").start()

    def _run(self, packed: bytes) -> None:
        try:
            cluster_class, request = cloudpickle.loads(packed)  # ``RayCluster``, handed over by its keep()
            self._launch = Launch(cluster_class(dataclasses.replace(request, display=self)))
            self._info.update(status="running", log_dir=self._launch.log_dir)
            outcome: tuple = ("ok", self._launch.run())
        except BaseException as error:
            outcome = ("error", error)
        status = self._launch.status if self._launch is not None else "failed"
        with self._changed:
            self._outcome = cloudpickle.dumps(outcome)
            self._info.update(status=status, ended=time.time())
            self._changed.notify_all()

    # The launch's display.
    def on_event(self, event: Event) -> None:
        try:
            body = pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # results or errors of classes defined in a notebook: by value
            body = cloudpickle.dumps(event)
        with self._changed:
            if len(self._first) < _FIRST_KEPT:
                self._first.append(body)
            else:
                self._rest.append(body)
                if len(self._rest) > _LAST_KEPT:
                    dropped = len(self._rest) - _LAST_KEPT
                    del self._rest[:dropped]
                    self._rest_start += dropped
            self._changed.notify_all()

    def close(self) -> None:
        pass

    # What drivers ask.
    def state(self) -> dict[str, Any]:
        return dict(self._info)

    def _count(self) -> int:
        return len(self._first) if len(self._first) < _FIRST_KEPT else self._rest_start + len(self._rest)

    def events(self, since: int, wait_s: float) -> tuple[int, list[bytes]]:
        """The events from number ``since`` on (waiting up to ``wait_s`` for one), and the number
        to ask from next time; events dropped from the middle of a long run are skipped."""
        with self._changed:
            self._changed.wait_for(lambda: self._count() > since or self._outcome is not None, wait_s)
            found = self._first[since:]
            found += self._rest[max(since, self._rest_start) - self._rest_start:]
            return self._count(), found

    def outcome(self) -> bytes | None:
        return self._outcome

    def signal(self, what: str) -> bool:
        if self._launch is None or self._outcome is not None:
            return False
        return self._launch.cancel() if what == "cancel" else self._launch.request_stacks()

    def forget(self) -> None:
        """A driver has the outcome: leave (the keeper's agents and placement group are gone already)."""
        import ray  # deferred: only ever called inside a Ray actor

        ray.actor.exit_actor()


class _RayEventReader:
    def __init__(self, ray: Any, keeper: Any) -> None:
        self._ray, self._keeper, self._next = ray, keeper, 0

    def read_available(self) -> list[Event]:
        try:
            self._next, bodies = self._ray.get(self._keeper.events.remote(self._next, 0.5))
        except Exception:  # the keeper left (collected) or died: the handle finds out which
            return []
        return [pickle.loads(body) for body in bodies]


class KeptOnRay:
    """A launch kept by a :class:`LaunchKeeper` actor, seen from a driver."""

    def __init__(self, ray: Any, keeper: Any, launch_id: str) -> None:
        self._ray, self._keeper, self.launch_id = ray, keeper, launch_id
        self.where = "the Ray cluster"
        self._last_state: dict[str, Any] = {"id": launch_id, "function": "?", "num_processes": 0, "started": 0.0}
        self._outcome: tuple | None = None

    def state(self) -> dict[str, Any]:
        try:
            self._last_state = self._ray.get(self._keeper.state.remote(), timeout=30)
        except Exception:
            pass  # gone: what it said last
        return dict(self._last_state)

    def alive(self) -> bool:
        try:
            self._ray.get(self._keeper.state.remote(), timeout=30)
            return True
        except Exception:
            return False

    def reader(self) -> _RayEventReader:
        return _RayEventReader(self._ray, self._keeper)

    def outcome(self) -> tuple[str, Any] | None:
        if self._outcome is None:
            try:
                blob = self._ray.get(self._keeper.outcome.remote(), timeout=30)
            except Exception:
                return None
            if blob is not None:
                self.state()  # its final status, kept here once the keeper has left
                self._outcome = cloudpickle.loads(blob)
        return self._outcome

    def mark_collected(self) -> None:
        self._keeper.forget.remote()  # the outcome is here now: the keeper may leave

    def signal(self, what: str) -> bool:
        try:
            return bool(self._ray.get(self._keeper.signal.remote(what), timeout=30))
        except Exception:
            return False

    def logs(self, rank: int) -> str:
        raise NotImplementedError(f"the ranks of a detached Ray launch log on their nodes: see {self.state().get('log_dir')} "
                                  "on each node (what they printed is also in attach()'s dashboard)")

    def lost_message(self) -> str:
        return (f"the actor keeping detached launch {self.launch_id} on the Ray cluster died before the launch "
                "ended (a node lost, or the cluster restarted); its ranks were stopped with it. Their logs are "
                f"on the Ray nodes, under {self._last_state.get('log_dir') or 'each node’s nblaunch log folder'}")


def start_on_ray(cluster_class: type, request: LaunchRequest, world_size: int) -> KeptOnRay:
    """Start ``request`` (checked already) under a detached keeper on the cluster this process is
    connected to, which runs it with ``cluster_class`` (``RayCluster``); returns at once."""
    ray, _ = ray_placement.connect()
    launch_id = uuid.uuid4().hex[:12]
    info = {"function": request.function_name, "num_processes": world_size, "kind": "launch"}
    packed = cloudpickle.dumps((cluster_class, dataclasses.replace(request, display="none")))
    keeper = ray.remote(LaunchKeeper).options(
        name=f"launch-{launch_id}", namespace=NAMESPACE, lifetime="detached", num_cpus=0,
        max_concurrency=_KEEPER_CONCURRENCY,
    ).remote(launch_id, packed, list(sys.path), info)
    return KeptOnRay(ray, keeper, launch_id)


def kept_on_ray() -> list[KeptOnRay]:
    """The detached launches kept on the cluster this process is connected to, oldest first."""
    import ray  # deferred: asked only where Ray is loaded and connected

    kept = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") == NAMESPACE and actor.get("name", "").startswith("launch-"):
            try:
                handle = ray.get_actor(actor["name"], namespace=NAMESPACE)
            except ValueError:
                continue  # it left between the listing and now
            kept.append(KeptOnRay(ray, handle, actor["name"][len("launch-"):]))
    return sorted(kept, key=lambda place: place.state().get("started", 0.0))
