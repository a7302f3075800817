"""A private Slurm on this machine, for tests and benchmarks: its own munged, slurmctld and one
slurmd per node, in a temporary directory of its own, on free ports, under a cluster name of its
own, so a system Slurm (or another instance) is never joined.

    with LocalSlurm(nodes=2, cpus=2) as slurm:
        slurm.run(["srun", "-N2", "-n4", "hostname"])

By hand: ``python -m tests.slurm.local_cluster up`` prints the ``export SLURM_CONF=...`` line and
keeps the cluster up until Ctrl-C. Needs Debian's slurmctld, slurmd, slurm-client and munge
(``bash .ci/slurm-setup.sh``); runs as root or as any other user (jobs run as that user).
"""

from __future__ import annotations

import argparse
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd")
# Debian puts the daemons in /usr/sbin, which a non-root PATH may lack.
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
# What srun/sbatch/salloc read from the environment as options, or as "you are inside job N"
# (SLURM_JOB_ID, SLURM_NTASKS, SLURM_CONF...): none may leak in from a Slurm job the tests run in.
INPUT_ENV_PREFIXES = ("SLURM_", "SALLOC_", "SBATCH_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_", "SACCT_")


def missing_daemons() -> list[str]:
    """The daemons of DAEMONS that are not installed (looking in the sbin directories too)."""
    return [d for d in DAEMONS if shutil.which(d, path=SBIN_PATH) is None]


def without_slurm_inputs(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without the variables Slurm's client commands take as input."""
    return {k: v for k, v in environ.items() if not k.startswith(INPUT_ENV_PREFIXES)}


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free now (the kernel's choice; all held until all are chosen)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll ``condition`` until it returns something true; TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return result


class LocalSlurm:
    """A Slurm cluster of ``nodes`` nodes (``nbl1``, ``nbl2``...) of ``cpus`` CPUs each, every node a
    slurmd of its own on this machine (Debian builds Slurm with multiple-slurmd support).
    ``start()`` returns once every node is idle; ``stop()`` cancels every job, stops the daemons
    and removes the directory."""

    def __init__(
        self, nodes: int = 2, cpus: int = 2, *, inactive_limit: int = 0, startup_timeout: float = 60.0
    ) -> None:
        # inactive_limit: 0 is Slurm's default and most sites': a job whose srun or salloc died
        # with its shepherd (a SIGKILL to its process group) stays until its time limit. A test of
        # what a site with InactiveLimit does can set it (slurmctld checks every ~30 s).
        self.nodes, self.cpus = nodes, cpus
        self.inactive_limit, self.startup_timeout = inactive_limit, startup_timeout
        self.node_names = [f"nbl{i + 1}" for i in range(nodes)]
        # Unique even across two imports of this module (as local_cluster and tests.slurm.local_cluster).
        self.cluster_name = f"nbl{os.getpid()}x{secrets.token_hex(3)}"
        self.dir: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}

    # -- what a test uses ---------------------------------------------------------------------

    @property
    def conf_path(self) -> Path:
        assert self.dir is not None, "LocalSlurm not started"
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Merge into a subprocess's environment to talk to this cluster. The client commands find
        the private munge socket through slurm.conf's AuthInfo: SLURM_CONF is all it takes."""
        return {"SLURM_CONF": str(self.conf_path)}

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """A whole environment for a Slurm command: ``base`` (default os.environ) without Slurm's
        input variables, plus ``env``. Jobs get this environment (srun's default --export=ALL)."""
        return without_slurm_inputs(dict(os.environ if base is None else base)) | self.env

    def run(self, args: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster: text output captured, checked (RuntimeError
        with its stderr), 60 s timeout; keywords override these and go to subprocess.run."""
        kw = {"env": self.environ(), "capture_output": True, "text": True, "check": True, "timeout": 60} | kw
        try:
            return subprocess.run(list(args), **kw)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{' '.join(args)} exited {e.returncode}: {(e.stderr or '').strip()}") from e

    def popen(self, args: Sequence[str], **kw) -> subprocess.Popen:
        """Start a Slurm command (srun, salloc) against this cluster without waiting for it."""
        return subprocess.Popen(list(args), **{"env": self.environ()} | kw)

    def jobs(self, all_states: bool = False) -> list[tuple[str, str, str]]:
        """(job id, state, name) of this cluster's jobs squeue lists: pending, running, completing;
        with ``all_states`` also the finished ones slurmctld still remembers (MinJobAge, 300 s)."""
        args = ["squeue", "-h", "-o", "%i|%T|%j"] + (["--states=all"] if all_states else [])
        return [tuple(line.split("|", 2)) for line in self.run(args).stdout.splitlines()]

    def steps(self) -> list[tuple[str, str]]:
        """("JOB.STEP", name) of this cluster's job steps (squeue -s)."""
        out = self.run(["squeue", "-h", "-s", "-o", "%i|%j"]).stdout
        return [tuple(line.split("|", 1)) for line in out.splitlines()]

    def stepds(self) -> list[psutil.Process]:
        """Live slurmstepd processes of this cluster. A slurmstepd shows an empty environment (it
        rewrites its process title over it), but it keeps its slurmd's working directory: ours."""
        found = []
        for proc in psutil.process_iter(["name", "status"]):
            # An exited slurmstepd is reparented to init and stays a zombie until init reaps it.
            if proc.info["name"] != "slurmstepd" or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                cwd = proc.cwd().removesuffix(" (deleted)")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if cwd == str(self.dir) or cwd.startswith(f"{self.dir}{os.sep}"):
                found.append(proc)
        return found

    # -- start and stop -----------------------------------------------------------------------

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalSlurm:
        if missing := missing_daemons():
            raise RuntimeError(f"{', '.join(missing)} not installed: bash .ci/slurm-setup.sh installs them")
        self.dir = Path(tempfile.mkdtemp(prefix=f"nblaunch-slurm-{self.cluster_name}-"))
        # munged wants every directory above its socket searchable by all (clients of any user).
        self.dir.chmod(0o755)
        try:
            self._start_munge()
            ctld_port, *node_ports = free_ports(1 + self.nodes)
            self.conf_path.write_text(self._slurm_conf(ctld_port, node_ports))
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf_path)])
            wait_for(self._ctld_up, self.startup_timeout, "slurmctld to answer")
            for name in self.node_names:
                (self.dir / "spool" / name).mkdir(parents=True)  # slurmd makes only the last level
                self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf_path)])
            wait_for(self._all_idle, self.startup_timeout, f"nodes {self.node_names} to be idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job and wait for them to leave, stop the daemons (SIGTERM, SIGKILL after
        10 s), kill any slurmstepd left, remove the directory. Safe to call twice."""
        if self.dir is None:
            return
        try:
            if self._alive("slurmctld"):
                try:
                    if ids := [job for job, _, _ in self.jobs()]:
                        self.run(["scancel", *ids], check=False)
                        wait_for(lambda: not self.jobs(), 30, "the cancelled jobs to leave")
                except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                    pass  # stopping anyway: what survives is killed below
            # The slurmds first (no node is marked down for it), munged last: the others use it.
            for name in [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
                if name in self.procs:
                    self._terminate(self.procs.pop(name))
            # A slurmstepd is no child of its slurmd (it double-forks), so nothing above ends one;
            # and one still reporting to a slurmd or slurmctld that is gone waits for it forever.
            # Their tasks with them: a task is a descendant of its slurmstepd (proctrack/linuxproc).
            doomed = []
            for stepd in self.stepds():
                try:
                    doomed += [stepd, *stepd.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
            for proc in doomed:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(doomed, timeout=5)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # -- internals ----------------------------------------------------------------------------

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge.socket"

    def _spawn(self, name: str, args: list[str]) -> None:
        """Start a daemon in the foreground, in a session of its own (a Ctrl-C in the terminal
        reaches the test, not the daemons), killed when this process dies (setpriv's
        PR_SET_PDEATHSIG: no daemon outlives a test run killed by SIGKILL)."""
        setpriv = shutil.which("setpriv")  # util-linux, "Essential" in Debian
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        env = self.environ() | {"PATH": SBIN_PATH}
        with open(self.dir / f"{name}.out", "wb") as out:
            self.procs[name] = subprocess.Popen(
                prefix + args, env=env, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def _alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def _check_daemons(self) -> None:
        """While starting: raise, with its logs' tails, if a daemon has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                logs = [self.dir / f"{name}.out", self.dir / f"{name}.log"]
                tail = "".join(p.read_text(errors="replace")[-3000:] for p in logs if p.exists())
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        subprocess.run([shutil.which("mungekey", path=SBIN_PATH), "--create", "--keyfile", str(key)], check=True)
        self._spawn("munged", [
            "munged", "--foreground", "--socket", str(self.munge_socket), "--key-file", str(key),
            "--log-file", str(self.dir / "munged.log"), "--pid-file", str(self.dir / "munged.pid"),
            "--seed-file", str(self.dir / "munged.seed"),
        ])  # fmt: skip

        def ready() -> bool:
            self._check_daemons()
            return self.munge_socket.exists()

        wait_for(ready, self.startup_timeout, "munged's socket")

    def _ctld_up(self) -> bool:
        self._check_daemons()
        ping = self.run(["scontrol", "ping"], check=False, timeout=10)
        return ping.returncode == 0 and "UP" in ping.stdout

    def _all_idle(self) -> bool:
        self._check_daemons()
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.node_names)

    @staticmethod
    def _terminate(proc: subprocess.Popen, backstop: float = 10.0) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(backstop)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _slurm_conf(self, ctld_port: int, node_ports: list[int]) -> str:
        d, host = self.dir, socket.gethostname().split(".")[0]
        user = pwd.getpwuid(os.getuid()).pw_name
        # Every node is this machine: its own slurmd on its own Port, its own spool (%n = node name).
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} State=UNKNOWN"
            for name, port in zip(self.node_names, node_ports)
        )
        return f"""\
# SavedByStrategy by tests/slurm/local_cluster.py: a private cluster; nothing here is shared.
ClusterName={self.cluster_name}
SlurmctldHost={host}(127.0.0.1)
# Never the default 6817/6818: a system Slurm on this machine is never joined.
SlurmctldPort={ctld_port}
SlurmdPort={node_ports[0]}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# The declared CPUs need not match this machine's cores.
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
# A batch job starts at once, not up to 3 s after sbatch (the default delay batches submissions).
SchedulerParameters=batch_sched_delay=0
# No slurmdbd: plain sacct says "accounting storage is disabled", but `sacct -c` reads the
# finished jobs (not steps) from the job completion file.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
# SIGTERM to SIGKILL of a cancelled job: 2 s, not 30.
KillWait=2
InactiveLimit={self.inactive_limit}
{nodes}
PartitionName=nbl Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.slurm.local_cluster")
    parser.add_argument("command", choices=["up"], help="start a cluster and keep it up until Ctrl-C")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args(argv)
    # SIGTERM (kill PID) stops it as cleanly as Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with LocalSlurm(nodes=args.nodes, cpus=args.cpus) as slurm:
        print(f"export SLURM_CONF={slurm.conf_path}")
        nodes = ", ".join(slurm.node_names)
        print(f"# {slurm.cluster_name}: {nodes}; logs in {slurm.dir}; Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
