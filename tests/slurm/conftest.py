"""A real Slurm cluster of two nodes (each its own slurmd, 2 CPUs) on this machine, shared by the
tests of a module, and the check that a test leaves nothing of itself in it.

Module scope, as the Ray lane's cluster: starting one takes about 0.25 s, so sharing it across
the whole session would save nothing, and a module that breaks its cluster (a node drained, a
daemon killed) breaks no other module."""

from __future__ import annotations

import time

import pytest
from local_cluster import LocalSlurm, missing_daemons


@pytest.fixture(scope="module")
def slurm():
    if missing := missing_daemons():
        pytest.skip(f"the Slurm lane needs {', '.join(missing)}: bash .ci/slurm-setup.sh installs Slurm and MUNGE")
    with LocalSlurm(nodes=2, cpus=2) as cluster:
        yield cluster


def leftovers(cluster: LocalSlurm) -> dict[str, list]:
    """What of ``cluster`` is still there: jobs, job steps (squeue) and slurmstepd processes."""
    return {"jobs": cluster.jobs(), "steps": cluster.steps(), "slurmstepd": cluster.stepds()}


@pytest.fixture
def nothing_left_in_slurm(slurm):
    """After the test: no job, no job step and no slurmstepd of the cluster remain. Cancelled or
    finished jobs pass through COMPLETING, so wait for them to leave, with a generous backstop."""
    yield
    deadline = time.monotonic() + 30
    while any((left := leftovers(slurm)).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if any(left.values()):
        # Cancel what the test left, so the next test of the module starts with an empty cluster.
        if ids := [job for job, _, _ in left["jobs"]]:
            slurm.run(["scancel", *ids], check=False)
        pytest.fail(f"left behind in Slurm: {left}")
