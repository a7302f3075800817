"""Deciding how a launch will run, from what the caller asked (:class:`LaunchRequest`) and
what this machine has: the :class:`LaunchPlan`.

All checks happen here (``checks`` holds those every home shares), before any process starts:
a refused launch leaves nothing behind.

Example::

    plan = make_plan(LaunchRequest(train, num_processes=2))
    plan.start_method, plan.master_port   # ("fork", 41231)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning import devices, ports, xla
from nblaunch.launch.planning.checks import (check_basics, check_elastic_arguments, check_fp8, check_open_files,
                                             check_restarts, port_number, positive_int, rendezvous_point)
from nblaunch.launch.planning.threads import threads_per_worker

START_METHODS = ("fork", "spawn", "xla")
CPU_RANKS_BY_DEFAULT = 2  # num_processes=None on a machine without GPUs: a real group, on any laptop


@dataclass(frozen=True)
class LaunchRequest:
    """What the caller asked for, as given (``notebook_launcher``'s arguments, unchecked):
    ``make_plan`` checks it. ``force_cpu`` hides the GPUs (``cpu=True``, ``debug_launcher``)."""

    function: Callable
    args: Any = ()
    num_processes: Any = None
    mixed_precision: Any = "no"
    use_port: Any = None
    master_addr: Any = "127.0.0.1"
    node_rank: Any = 0
    num_nodes: Any = 1
    start_method: Any = None
    timeout: Any = None
    display: Any = "auto"
    force_cpu: bool = False
    max_restarts: Any = 0
    monitor_interval: Any = 0.1
    rdzv_backend: Any = "static"
    rdzv_endpoint: Any = ""
    rdzv_conf: Any = None
    rdzv_id: Any = "none"
    log_line_prefix_template: Any = None

    @property
    def function_name(self) -> str:
        return getattr(self.function, "__qualname__", None) or repr(self.function)


@dataclass(frozen=True)
class LaunchPlan:
    """How one launch runs: who, where, how it starts, where the ranks meet."""

    function_name: str
    num_processes: int  # ranks on this node
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    start_method: str
    start_reason: str
    device_kind: str  # "cpu", "cuda" or "xla"
    threads: int | None
    mixed_precision: str
    force_cpu: bool
    xla_environ: dict[str, str] | None = None  # XLA only: what the host process adds to its environment
    max_restarts: int = 0  # after a rank fails, start every rank again up to this many times
    restart: int = 0  # which start this is: 0 first, 1 the first restart, ...
    port_pinned: bool = False  # use_port given: every restart meets there again
    run_id: str = "none"  # torchrun's TORCHELASTIC_RUN_ID (Accelerate's rdzv_id), "none" as torchrun's default

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def meeting_point(self) -> str:
        """Where the ranks meet, when it is not ``master_addr:master_port``."""
        return "torch_xla" if self.start_method == "xla" else ""

    @property
    def devices(self) -> str:
        if self.device_kind == "xla":
            return f"{plural(self.num_processes, 'XLA device')} ({os.environ.get('PJRT_DEVICE') or 'TPU'})"
        if self.device_kind == "cuda":
            return plural(self.num_processes, "CUDA GPU")
        threads = f", {plural(self.threads, 'thread')} each" if self.threads else ""
        return f"CPU{threads}"

    def rank_environ(self, local_rank: int) -> dict[str, str]:
        """The variables torch.distributed (and our Accelerator) read in rank ``local_rank``."""
        env = {
            "RANK": str(self.node_rank * self.num_processes + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.num_processes),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NBLAUNCH_MIXED_PRECISION": self.mixed_precision,
            # What Hugging Face Accelerate (and so transformers' Trainer) reads, as its own
            # launchers set it: code that keeps `accelerate` gets the same launch.
            "ACCELERATE_MIXED_PRECISION": self.mixed_precision,
            # torchrun always sets it, and libraries ask torch.distributed.is_torchelastic_launched()
            # to trust the variables above: Lightning then checks its devices= against WORLD_SIZE
            # (a mismatch is a clear error instead of a hang waiting for ranks that never come).
            "TORCHELASTIC_RUN_ID": self.run_id,
        }
        if self.device_kind == "cpu" and self.world_size > 1:
            # Without it Accelerate's state joins no process group on a CPU: every rank would
            # train the whole data set alone. (With one rank it would make a group of one.)
            env["ACCELERATE_USE_CPU"] = "true"
        if self.max_restarts:
            # torchrun's names: code written for elastic restarts reads them to resume.
            env["TORCHELASTIC_RESTART_COUNT"] = str(self.restart)
            env["TORCHELASTIC_MAX_RESTARTS"] = str(self.max_restarts)
        if self.force_cpu:
            env["NBLAUNCH_FORCE_CPU"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 thread``, ``2 threads``; ``plural(1, "GPU is", "GPUs are")``: ``1 GPU is``."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def start_method_for(requested: str | None, force_cpu: bool) -> tuple[str, str]:
    """How ranks would start here, and why: ``("fork", "the quickest start: ...")``."""
    if requested is not None and requested not in START_METHODS:
        raise LaunchConfigError(f"start_method must be None (choose for me), 'fork', 'spawn' or 'xla', got {requested!r}")
    cuda_in_parent = not force_cpu and devices.cuda_initialized()
    if requested == "spawn":
        return "spawn", "asked for with start_method='spawn'"
    if not hasattr(os, "fork") or sys.platform != "linux":
        if requested == "fork":
            raise LaunchConfigError(f"start_method='fork' is not safe on {sys.platform}; use start_method=None")
        return "spawn", f"fork is not safe on {sys.platform}"
    if cuda_in_parent:
        if requested == "fork":
            raise LaunchConfigError(
                "start_method='fork' would break CUDA in the workers: CUDA is already initialised in this "
                "process. Use start_method=None (nblaunch then spawns), or move the CUDA code into the function."
            )
        return "spawn", "CUDA is already initialised in this process, and forked workers could not use it"
    if requested == "fork":
        return "fork", "asked for with start_method='fork'"
    return "fork", "the quickest start: each process begins as a copy of this one"


def make_plan(request: LaunchRequest) -> LaunchPlan:
    """Check every argument and decide how to launch on this machine; raises LaunchConfigError
    on bad input."""
    r = request
    function, num_processes, master_addr, node_rank, start_method, force_cpu = (
        r.function, r.num_processes, r.master_addr, r.node_rank, r.start_method, r.force_cpu)
    mixed_precision = check_basics(function, r.args, r.mixed_precision, r.timeout, r.display)
    num_nodes = positive_int("num_nodes", r.num_nodes)
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < num_nodes:
        raise LaunchConfigError(f"node_rank must be an int in 0..num_nodes-1 (num_nodes={num_nodes}), got {node_rank!r}")
    if not isinstance(master_addr, str) or not master_addr:
        raise LaunchConfigError(f"master_addr must be a host name or address, got {master_addr!r}")
    max_restarts = check_restarts(r.max_restarts, num_nodes)
    check_elastic_arguments(r)
    master_addr, use_port = rendezvous_point(master_addr, r.use_port, r.rdzv_endpoint)
    port = port_number(use_port)
    if port is None and num_nodes > 1:
        raise LaunchConfigError(
            "with num_nodes > 1, every node must agree on the port: pass the same use_port=... on every node"
        )

    if start_method == "xla" or (start_method is None and not force_cpu and xla.tpu_markers()):
        if max_restarts:
            raise LaunchConfigError("max_restarts is not supported on XLA (torch_xla's xmp.spawn starts the ranks)")
        return _xla_plan(r.function_name, num_processes, mixed_precision, master_addr, start_method, port)
    gpus = 0 if force_cpu else devices.cuda_device_count()
    if num_processes is None:
        num_processes = gpus or CPU_RANKS_BY_DEFAULT
    num_processes = positive_int("num_processes", num_processes)
    device_kind = "cuda" if gpus else "cpu"
    if device_kind == "cuda" and num_processes > gpus:
        raise LaunchConfigError(
            f"num_processes={num_processes}, but {plural(gpus, 'GPU is', 'GPUs are')} visible and a GPU rank "
            f"needs a GPU of its own: pass num_processes={gpus} (or leave it out), or cpu=True to run "
            f"{num_processes} ranks on the CPU (to try or debug distributed code)."
        )
    check_fp8(mixed_precision, device_kind)
    check_open_files(num_processes)
    method, reason = start_method_for(start_method, force_cpu)
    master_port = ports.choose_port(master_addr, port, hosted_here=node_rank == 0)
    name = r.function_name
    return LaunchPlan(
        function_name=name,
        num_processes=num_processes,
        num_nodes=num_nodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        start_method=method,
        start_reason=reason,
        device_kind=device_kind,
        threads=threads_per_worker(num_processes),
        mixed_precision=mixed_precision,
        force_cpu=force_cpu,
        max_restarts=max_restarts,
        port_pinned=port is not None,
        run_id=r.rdzv_id,
    )


def _xla_plan(name: str, num_processes: Any, mixed_precision: str, master_addr: str,
              requested: str | None, port: int | None) -> LaunchPlan:
    """A launch through torch_xla's xmp.spawn: every local XLA device is a rank."""
    if num_processes is not None:
        num_processes = positive_int("num_processes", num_processes)
    xla.check_usable()
    if mixed_precision in ("fp16", "fp8"):
        raise LaunchConfigError(f"mixed_precision={mixed_precision!r} is not supported on XLA devices; use 'bf16' or 'no'")
    count, host_environ = xla.local_device_count(num_processes)
    if requested == "xla":
        reason = "asked for with start_method='xla'"
    else:
        reason = f"TPU host ({', '.join(xla.tpu_markers())})"
    return LaunchPlan(
        function_name=name,
        num_processes=count,
        num_nodes=1,
        node_rank=0,
        master_addr=master_addr,
        master_port=ports.choose_port(master_addr, port, hosted_here=True),  # unused by XLA; kept for the record
        start_method="xla",
        start_reason=reason + "; torch_xla's xmp.spawn starts one process per chip",
        device_kind="xla",
        threads=None,
        mixed_precision=mixed_precision,
        force_cpu=False,
        xla_environ=dict(host_environ, NBLAUNCH_MIXED_PRECISION=mixed_precision, NBLAUNCH_XLA="1"),
    )
