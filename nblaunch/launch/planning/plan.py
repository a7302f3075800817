"""Deciding how a launch will run: its :class:`LaunchPlan`, from the checked
:class:`~nblaunch.launch.planning.request.LaunchRequest` and what the cluster has.

Each cluster makes the plan for its ranks: this machine's in :func:`plan_here` (GPUs, start
method, a free port, the XLA host), a Ray cluster's in ``nblaunch.cluster.ray_cluster``; both take
their ranks per node from :func:`ranks_per_node`. Nothing starts here: a refused launch leaves
nothing behind.

Example::

    plan = plan_here(LaunchRequest(train, num_processes=2))
    plan.start_method, plan.master_port   # ("fork", 41231)
    plan.rank_environ(1)["RANK"]          # "1"
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
import sys
import warnings
from dataclasses import dataclass

from nblaunch.contract import variables as v
from nblaunch.contract.precision import AUTO, FP8_EMULATED_ON_CPU, FP8_HARDWARE, fast_precision
from nblaunch.detached.store import state_root
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning import cuda_culprit, devices, ports, tpu
from nblaunch.launch.planning.compile_cache import compile_environ
from nblaunch.launch.planning.request import START_METHODS, LaunchRequest
from nblaunch.launch.planning.threads import threads_per_worker

CPU_RANKS_BY_DEFAULT = 2  # num_processes=None on a machine without GPUs: a real group, on any laptop


@dataclass(frozen=True)
class LaunchPlan:
    """How one launch runs: who, where, how it starts, where the ranks meet, in what precision.
    The request's own settings (function, cpu, restarts, ...) are read from ``request``, never
    copied; what the plan decides from them is here (ranks per node from ``num_processes=None``,
    ``precision`` from ``mixed_precision="auto"``)."""

    request: LaunchRequest
    num_processes: int  # ranks on this node
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    start_method: str
    start_reason: str
    device_kind: str  # "cpu", "cuda" or "xla"
    devices: str  # in words, for the launch's first line: "2 CUDA GPUs", "CPU, 4 threads each"
    shown_ranks: int  # the ranks this launch shows, a pane and a log each: this node's, or every node's
    precision: str  # the request's mixed_precision, "auto" decided for these devices (contract.precision)
    threads: int | None = None  # intra-op threads per rank; None leaves the user's choice alone
    meeting_point: str = ""  # where the ranks meet, when it is not master_addr:master_port
    xla_environ: dict[str, str] | None = None  # XLA only: what the host process adds to its environment
    restart: int = 0  # which start this is: 0 first, 1 the first restart, ...
    port_pinned: bool = False  # use_port given: every restart meets there again

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    def rank_environ(self, local_rank: int) -> dict[str, str]:
        """The variables torch.distributed (and our Accelerator) read in rank ``local_rank``."""
        request = self.request
        env = {
            v.RANK: str(self.node_rank * self.num_processes + local_rank),
            v.LOCAL_RANK: str(local_rank),
            v.WORLD_SIZE: str(self.world_size),
            v.LOCAL_WORLD_SIZE: str(self.num_processes),
            v.NODE_RANK: str(self.node_rank),
            v.GROUP_RANK: str(self.node_rank),
            v.MASTER_ADDR: self.master_addr,
            v.MASTER_PORT: str(self.master_port),
            v.MIXED_PRECISION: self.precision,
            # What Hugging Face Accelerate (and so transformers' Trainer) reads, as its own
            # launchers set it: code that keeps `accelerate` gets the same launch.
            v.ACCELERATE_MIXED_PRECISION: self.precision,
            # torchrun always sets it, and libraries ask torch.distributed.is_torchelastic_launched()
            # to trust the variables above: Lightning then checks its devices= against WORLD_SIZE
            # (a mismatch is a clear error instead of a hang waiting for ranks that never come).
            v.TORCHELASTIC_RUN_ID: request.run_id,
        }
        env.update(compile_environ(self.num_processes))  # compiled code kept for the next launch
        if request.stall_after is not None:
            env[v.STALL_AFTER] = repr(float(request.stall_after))
        env[v.CHECKPOINTS] = launch_checkpoints(request.function_name)  # where a stop saves without project_dir
        if request.resume:
            env[v.RESUME] = "latest" if request.resume is True else request.resume
        if self.device_kind != "xla":
            # The store lives in node 0's launcher, not in rank 0, and no rank leaves
            # init_process_group before every rank's group is connected: see launch/rendezvous.py.
            env[v.TORCHELASTIC_USE_AGENT_STORE] = str(True)
            env[v.TORCH_DIST_INIT_BARRIER] = "1"
        if self.device_kind == "cpu" and self.world_size > 1:
            # Without it Accelerate's state joins no process group on a CPU: every rank would
            # train the whole data set alone. (With one rank it would make a group of one.)
            env[v.ACCELERATE_USE_CPU] = "true"
        if request.max_restarts:
            # torchrun's names: code written for elastic restarts reads them to resume.
            env[v.TORCHELASTIC_RESTART_COUNT] = str(self.restart)
            env[v.TORCHELASTIC_MAX_RESTARTS] = str(request.max_restarts)
        if request.cpu:
            env[v.FORCE_CPU] = "1"
            env[v.CUDA_VISIBLE_DEVICES] = ""
        return env


def launch_checkpoints(function_name: str) -> str:
    """Where a launch of ``function_name`` saves its work when stopped and its Accelerator has no
    ``project_dir``: one folder per function under the user's state folder, so that ``resume=True``
    in a new process finds it."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", function_name).strip("._") or "function"
    return os.path.join(state_root(), "runs", safe, "checkpoints")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 thread``, ``2 threads``; ``plural(1, "GPU is", "GPUs are")``: ``1 GPU is``."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def ranks_per_node(request: LaunchRequest, gpus: int) -> int:
    """The ranks each node runs: as asked, else one per GPU (``gpus`` each node gives the
    launch), else ``CPU_RANKS_BY_DEFAULT``. Every cluster counts this way."""
    return request.num_processes or gpus or CPU_RANKS_BY_DEFAULT


def decided_precision(mixed_precision: str, device_kind: str, capability: tuple[int, int] | None) -> str:
    """``mixed_precision`` as these devices run it: "auto" becomes the fast one for them
    (``contract.precision.fast_precision``), every other word stays as asked."""
    return fast_precision(device_kind, capability) if mixed_precision == AUTO else mixed_precision


def start_method_for(requested: str | None, cpu: bool) -> tuple[str, str]:
    """How ranks would start here, and why: the one place that decides. ``("fork", "the
    quickest start: ...")``; ``"server"``: forked by the launch server (Linux, where this process
    cannot fork them or ``start_method="spawn"`` asked for a fresh start); ``"spawn"``: a fresh
    interpreter each (elsewhere)."""
    if requested is not None and requested not in START_METHODS:
        raise LaunchConfigError(f"start_method must be None (choose for me), 'fork', 'spawn' or 'xla', got {requested!r}")
    linux = hasattr(os, "fork") and sys.platform == "linux"
    if requested == "spawn":
        if linux:
            return "server", ("asked for with start_method='spawn': they are forked by a process that imported torch "
                              "and never touched CUDA, not by this one")
        return "spawn", "asked for with start_method='spawn'"
    if not linux:
        if requested == "fork":
            raise LaunchConfigError(f"start_method='fork' is not safe on {sys.platform}; use start_method=None")
        return "spawn", f"fork is not safe on {sys.platform}"
    if not cpu and devices.cuda_initialized():
        line = cuda_culprit.where_cuda_started()
        where = f"at {line}" if line else cuda_culprit.unseen_reason()
        if requested == "fork":
            raise LaunchConfigError(
                f"start_method='fork' would break CUDA in the workers: CUDA was already initialised in this "
                f"process, {where}. Use start_method=None (nblaunch then starts the ranks from its launch "
                "server), or move the CUDA code into the function."
            )
        return "server", f"CUDA was initialised in this process {where}, and forked workers could not use it"
    if requested == "fork":
        return "fork", "asked for with start_method='fork'"
    return "fork", "the quickest start: each process begins as a copy of this one"


def plan_here(request: LaunchRequest) -> LaunchPlan:
    """How ``request`` runs on this machine: its GPUs (or TPUs), start method, rendezvous.
    Raises LaunchConfigError where this machine cannot run it."""
    r = request
    if r.resources:
        raise LaunchConfigError("resources= says what to ask a cluster for: pass cluster='slurm' with it (a launch "
                                "on this machine asks for nothing)")
    num_nodes = r.num_nodes or 1
    if r.max_restarts and num_nodes > 1:
        raise LaunchConfigError(
            "max_restarts works on one machine only for now: with num_nodes > 1 the nodes could not agree on "
            "when to restart. Pass max_restarts=0, or resume from a checkpoint with a new launch.")
    if num_nodes > 1 and r.use_port is None:
        raise LaunchConfigError(
            "with num_nodes > 1, every node must agree on the port: pass the same use_port=... on every node")
    if r.start_method == "xla" or (r.start_method is None and not r.cpu and tpu.tpu_markers()):
        return _xla_plan(r)
    gpus = 0 if r.cpu else devices.cuda_device_count()
    num_processes = ranks_per_node(r, gpus)
    device_kind = "cuda" if gpus else "cpu"
    if device_kind == "cuda" and num_processes > gpus:
        raise LaunchConfigError(
            f"num_processes={num_processes}, but {plural(gpus, 'GPU is', 'GPUs are')} visible and a GPU rank "
            f"needs a GPU of its own: pass num_processes={gpus} (or leave it out), or cpu=True to run "
            f"{num_processes} ranks on the CPU (to try or debug distributed code)."
        )
    precision = decided_precision(r.mixed_precision, device_kind, devices.cuda_capability() if gpus else None)
    check_fp8(precision, device_kind, devices.cuda_capability() if gpus else None)
    check_open_files(num_processes)
    method, reason = start_method_for(r.start_method, r.cpu)
    threads = threads_per_worker(num_processes)
    if device_kind == "cuda":
        words = plural(num_processes, "CUDA GPU")
    else:
        words = "CPU" + (f", {plural(threads, 'thread')} each" if threads else "")
    return LaunchPlan(
        request=r,
        num_processes=num_processes,
        num_nodes=num_nodes,
        node_rank=r.node_rank,
        master_addr=r.master_addr,
        master_port=ports.choose_port(r.master_addr, r.use_port, hosted_here=r.node_rank == 0),
        start_method=method,
        start_reason=reason,
        device_kind=device_kind,
        devices=words,
        shown_ranks=num_processes,
        precision=precision,
        threads=threads,
        port_pinned=r.use_port is not None,
    )


def _xla_plan(request: LaunchRequest) -> LaunchPlan:
    """A launch through torch_xla's xmp.spawn: every local XLA device is a rank."""
    if request.max_restarts:
        raise LaunchConfigError("max_restarts is not supported on XLA (torch_xla's xmp.spawn starts the ranks)")
    tpu.check_usable()
    precision = decided_precision(request.mixed_precision, "xla", None)
    if precision in ("fp16", "fp8"):
        raise LaunchConfigError(f"mixed_precision={precision!r} is not supported on XLA devices; use 'bf16' or 'no'")
    count, host_environ = tpu.local_device_count(request.num_processes)
    if request.start_method == "xla":
        reason = "asked for with start_method='xla'"
    else:
        reason = f"TPU host ({', '.join(tpu.tpu_markers())})"
    return LaunchPlan(
        request=request,
        num_processes=count,
        num_nodes=1,
        node_rank=0,
        master_addr=request.master_addr,
        master_port=ports.choose_port(request.master_addr, request.use_port, hosted_here=True),  # unused by XLA
        start_method="xla",
        start_reason=reason + "; torch_xla's xmp.spawn starts one process per chip",
        device_kind="xla",
        devices=f"{plural(count, 'XLA device')} ({os.environ.get(v.PJRT_DEVICE) or 'TPU'})",
        shown_ranks=count,
        precision=precision,
        meeting_point="torch_xla",
        xla_environ=dict(host_environ, **{v.MIXED_PRECISION: precision, v.XLA_LAUNCH: "1"}),
    )


def check_fp8(mixed_precision: str, device_kind: str, capability: tuple[int, int] | None = None) -> None:
    """Say before any process starts where fp8 cannot run or runs slowly: it trains through torchao
    (the ``nblaunch[fp8]`` extra), fast on GPUs of compute capability 8.9 on, emulated on the CPU."""
    if mixed_precision != "fp8":
        return
    if device_kind == "cuda" and capability is not None and capability < FP8_HARDWARE:
        raise LaunchConfigError(f"mixed_precision='fp8' needs GPUs with fp8 units (compute capability 8.9 and "
                                f"later); this machine's are {capability[0]}.{capability[1]}: use 'bf16' (or 'fp16' "
                                "where bf16 is emulated), or cpu=True to try fp8 emulated on the CPU")
    if importlib.util.find_spec("torchao") is None:
        raise LaunchConfigError('mixed_precision=\'fp8\' trains through torchao, which is not installed: '
                                'pip install "nblaunch[fp8]" (or use mixed_precision=\'bf16\')')
    if device_kind == "cpu":
        warnings.warn(FP8_EMULATED_ON_CPU, stacklevel=5)


# Open files the launcher holds per rank: 4 pipe ends, a pidfd, a log file (and, while a rank
# starts, its 4 other pipe ends); plus a few for the launch itself.
_FILES_PER_RANK = 10
_FILES_PER_LAUNCH = 16


def check_open_files(num_processes: int) -> None:
    """Refuse a launch that would run out of file descriptors halfway through starting."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        return
    needed = in_use + _FILES_PER_RANK * num_processes + _FILES_PER_LAUNCH
    if needed > soft:
        can_raise = hard == resource.RLIM_INFINITY or needed <= hard
        how = (f"raise the limit first: import resource; resource.setrlimit(resource.RLIMIT_NOFILE, "
               f"({needed}, {'resource.RLIM_INFINITY' if hard == resource.RLIM_INFINITY else hard}))"
               if can_raise else f"the hard limit is {hard}: use fewer processes or raise it (ulimit -Hn)")
        raise LaunchConfigError(
            f"num_processes={num_processes} needs about {needed} open files in this process, but the limit "
            f"is {soft} (ulimit -n); {how}"
        )
