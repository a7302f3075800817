"""The private Slurm the Slurm lane runs on (local_cluster.LocalSlurm) is a real one: two nodes of
two CPUs, steps across both, allocations, steps inside them, cancellation, and nothing left."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from local_cluster import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("nothing_left_in_slurm")]


def test_its_own_cluster_never_the_system_one(slurm):
    config = dict(
        line.split("=", 1) for line in slurm.run(["scontrol", "show", "config"]).stdout.splitlines() if " = " in line
    )
    config = {k.strip(): v.strip() for k, v in config.items()}
    assert config["ClusterName"] == slurm.cluster_name
    assert config["SlurmctldPort"] != "6817"
    assert config["AuthInfo"] == f"socket={slurm.munge_socket}"
    # Two slurmd on one machine need Slurm built with multiple-slurmd support (Debian's is).
    assert config["MULTIPLE_SLURMD"] == "Yes"


def test_a_step_runs_one_task_per_cpu_across_both_nodes(slurm):
    out = slurm.run(["srun", "-N2", "-n4", "bash", "-c", "echo $SLURMD_NODENAME $SLURM_NODEID $SLURM_PROCID"]).stdout
    assert sorted(out.split("\n")[:-1]) == ["nbl1 0 0", "nbl1 0 1", "nbl2 1 2", "nbl2 1 3"]


def test_tasks_see_the_submitting_environment_and_python(slurm):
    # srun's default --export=ALL: a task gets the environment srun was started with.
    env = slurm.environ() | {"NBL_MARK": "from-the-test"}
    probe = "import os, sys; print(sys.prefix, os.environ['NBL_MARK'], os.environ['SLURM_PROCID'])"
    out = slurm.run(["srun", "-N2", "-n2", sys.executable, "-c", probe], env=env).stdout
    assert sorted(out.split("\n")[:-1]) == [f"{sys.prefix} from-the-test {rank}" for rank in (0, 1)]


def test_an_allocation_its_steps_and_scancel(slurm):
    granted = slurm.run(["salloc", "-N2", "-n4", "--no-shell", "-J", "nbl-alloc"]).stderr
    job = re.search(r"Granted job allocation (\d+)", granted).group(1)
    assert (job, "RUNNING", "nbl-alloc") in slurm.jobs()

    # A step that takes every CPU of the allocation...
    busy = slurm.popen(["srun", f"--jobid={job}", "-N2", "-n4", "-J", "busy", "sleep", "300"], stderr=subprocess.PIPE)
    wait_for(lambda: (f"{job}.0", "busy") in slurm.steps(), 30, "the busy step")
    wait_for(lambda: len(slurm.stepds()) == 2, 30, "a slurmstepd on each node")
    # ...and one beside it, which --overlap lets share them.
    probe = ["bash", "-c", "echo $SLURM_JOB_ID $SLURM_STEP_ID $SLURM_NODEID"]
    out = slurm.run(["srun", f"--jobid={job}", "--overlap", "-N2", "-n2", *probe]).stdout
    assert sorted(out.split("\n")[:-1]) == [f"{job} 1 0", f"{job} 1 1"]

    # Cancelling a step leaves its allocation; cancelling the allocation ends everything in it.
    slurm.run(["scancel", f"{job}.0"])
    assert busy.wait(30) != 0
    wait_for(lambda: not slurm.steps(), 30, "the cancelled step to leave")
    assert [j for j, _, _ in slurm.jobs()] == [job]
    slurm.run(["scancel", job])
    wait_for(lambda: not slurm.jobs(), 30, "the cancelled allocation to leave")


def test_sacct_knows_finished_jobs_without_a_database(slurm):
    """No slurmdbd: `sacct -c` reads the job completion file (jobs, not steps)."""
    job = slurm.run(["sbatch", "--parsable", "-N1", "-o", "/dev/null", "--wrap", "true"]).stdout.strip()

    def state() -> str:
        return slurm.run(["sacct", "-c", "-n", "-P", "-o", "State", "-j", job]).stdout.strip()

    assert wait_for(state, 30, f"job {job} in sacct") == "COMPLETED"
