"""8. Several machines on Ray: a 2-node cluster simulated on this machine (2 raylets, 2 CPUs each).

Every launch runs 4 ranks (2 per node) that import torch, form a gloo group and all_reduce once.

- nblaunch: ``notebook_launcher(..., num_nodes=2, cluster="ray")``: the first launch places a
  group and one agent per node (it imports torch once; its ranks fork from it), which the next
  launch takes (kept between launches, issue 60); ``nblaunch.preloaded().release()`` removes them.
- nblaunch warm: ``notebook_launcher(..., ranks=pool)`` on ``WarmRanks(num_processes=2, num_nodes=2,
  cluster="ray")``: agents and ranks already up, the group already formed.
- raw Ray: what a user writes by hand: a placement group, one actor per rank that imports torch,
  joins the group (node 0's address and a free port) and all_reduces; actors killed and the
  group removed after.
- Ray Train: ``TorchTrainer(...).fit()`` with 4 CPU workers (when ``ray[train]`` is installed).
- The floor under any launch on Ray: a placement group and one actor per node, started, asked
  one question and removed; then the same with each actor importing torch (nblaunch's agents
  import it once so their ranks inherit it).

Failure: rank 3 (on node 1) raises while the others wait in an all_reduce; from the raise to the
call raising, and which rank the error names first. After every launch Ray's state API is asked
for live actors and placement groups.
"""

from __future__ import annotations

import os
import tempfile
import time

from benchmarks.common import interleave, pair_ratios, row

GOAL_FIRST_S = 3.0
GOAL_WARM_S = 0.3
GOAL_FAILURE_S = 0.5
WORLD = 4


def all_reduce_4(out_dir: str | None = None) -> float:
    """A rank's work: import torch, join the group, one all_reduce."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def fail_on_rank_3(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 3:
        time.sleep(0.2)  # the others are in the all_reduce by now
        with open(os.path.join(out_dir, "failed_at"), "w") as f:
            f.write(repr(time.time()))  # one machine: one clock for the driver and the nodes
        raise RuntimeError("rank 3 fails on purpose")
    dist.all_reduce(torch.ones(4))
    time.sleep(30)


def _raw_ray_launch() -> list[float]:
    """Hand-written: one actor per rank in a placement group, node 0 hosting the store."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Rank:
        def address(self):
            import socket

            with socket.socket() as s:
                s.bind(("", 0))
                return ray.util.get_node_ip_address(), s.getsockname()[1]

        def run(self, rank, addr, port):
            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
            return all_reduce_4()

    group = placement_group([{"CPU": 2}, {"CPU": 2}], strategy="STRICT_SPREAD")
    actors = [Rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r // 2)).remote()
              for r in range(WORLD)]
    try:
        addr, port = ray.get(actors[0].address.remote())
        return ray.get([a.run.remote(r, addr, port) for r, a in enumerate(actors)])
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def _ray_floor(import_torch: bool) -> None:
    """The floor under any launch on Ray: a placement group, one actor per node started and asked
    one question (importing torch there, or not), then everything removed. No rank, no group."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=2)
    class Node:
        def ready(self, with_torch):
            if with_torch:
                import torch  # noqa: F401
            return os.getpid()

    group = placement_group([{"CPU": 2}, {"CPU": 2}], strategy="STRICT_SPREAD")
    actors = [Node.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=n)).remote()
              for n in range(2)]
    try:
        ray.get([a.ready.remote(import_torch) for a in actors])
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def _ray_train_fit() -> None:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        all_reduce_4()

    TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False,
                                                    resources_per_worker={"CPU": 1})).fit()


def _leftovers() -> int:
    from ray.util.state import list_actors, list_placement_groups

    return (len([a for a in list_actors(limit=1000) if a.state != "DEAD"])
            + len([g for g in list_placement_groups(limit=1000) if g.state != "REMOVED"]))


def _failure_once() -> dict:
    from nblaunch import RankFailedError, notebook_launcher

    with tempfile.TemporaryDirectory() as tmp:
        try:
            notebook_launcher(fail_on_rank_3, args=(tmp,), num_processes=2, num_nodes=2, cluster="ray", display="none")
            return {"latency_s": None, "right_rank": False}
        except RankFailedError as error:
            raised = time.time()
            with open(os.path.join(tmp, "failed_at")) as f:
                return {"latency_s": raised - float(f.read()), "right_rank": error.root_cause.rank == 3}


def run(quick: bool = False, size: str | None = None) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    import nblaunch
    from nblaunch import WarmRanks, notebook_launcher

    rounds = 3 if quick else 8
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    rows, notes = [], []
    try:
        have_train = True
        try:
            import ray.train.torch  # noqa: F401
        except ImportError:
            have_train = False
            notes.append("Ray Train: not installed (pip install 'ray[train]'); not measured")

        left: dict[str, list[int]] = {}

        def timed(impl, launch):
            def one():
                t0 = time.perf_counter()
                launch()
                elapsed = time.perf_counter() - t0
                left.setdefault(impl, []).append(_leftovers())
                return elapsed
            return one

        nblaunch_launch = lambda: notebook_launcher(all_reduce_4, num_processes=2, num_nodes=2,  # noqa: E731
                                                    cluster="ray", display="none")
        kept_launches: list[float] = []

        def first_then_kept() -> float:
            """The first launch onto the cluster (nothing kept), then one onto the nodes it kept;
            what they hold is let go after, for the others' turn (2 CPUs a node: nothing else fits)."""
            nblaunch.preloaded().release()
            first_s = timed("nblaunch", nblaunch_launch)()
            t0 = time.perf_counter()
            nblaunch_launch()
            kept_launches.append(time.perf_counter() - t0)
            nblaunch.preloaded().release()
            left.setdefault("nblaunch, after preloaded().release()", []).append(_leftovers())
            return first_s

        samples = interleave(rounds, {"nblaunch": first_then_kept,
                                      "raw Ray": timed("raw Ray", _raw_ray_launch),
                                      "floor": timed("floor", lambda: _ray_floor(False)),
                                      "floor + torch": timed("floor + torch", lambda: _ray_floor(True))})
        for impl, errs in samples["_errors"].items():
            notes.append(f"{impl}: {len(errs)} failed: {errs[0]}")
        first = samples["nblaunch"]
        launch_rows = [row("raw Ray", "the same by hand", "s", samples["raw Ray"]),
                       row("raw Ray", "the floor: a placement group, one actor per node started and removed", "s",
                           samples["floor"]),
                       row("raw Ray", "the floor, each node's actor importing torch", "s", samples["floor + torch"])]
        # What one node costs when it has the cores to itself: one node, 2 ranks (so 1 agent).
        one_node = [timed("nblaunch", lambda: notebook_launcher(all_reduce_4, num_processes=2, cluster="ray",
                                                                 display="none"))() for _ in range(rounds // 2)]
        launch_rows.append(row("nblaunch", "the same on 1 node (2 ranks, 1 agent; the first places it, the others "
                               "take what it kept)", "s", one_node))
        ratios = {"vs raw Ray": pair_ratios(first, samples["raw Ray"])}

        with WarmRanks(num_processes=2, num_nodes=2, cluster="ray", display="none") as ranks:
            ranks.run(all_reduce_4)  # the agents start and the group forms: not part of a warm call
            warm = []
            for _ in range(10 if quick else 50):
                t0 = time.perf_counter()
                notebook_launcher(all_reduce_4, ranks=ranks, display="none")
                warm.append(time.perf_counter() - t0)
        left["nblaunch warm"] = [_leftovers()]
        rows.append(row("nblaunch warm", "a launch on warm agents and ranks (ranks=WarmRanks(..., cluster='ray'))", "s", warm,
                        goal=f"<= {GOAL_WARM_S:g} s", met=sorted(warm)[len(warm) // 2] <= GOAL_WARM_S,
                        ratios={"vs nblaunch launch": pair_ratios(warm[:len(first)], first)}))

        failures = []
        for _ in range(3 if quick else 10):
            failures.append(_failure_once())
            left.setdefault("nblaunch", []).append(_leftovers())
        latencies = [f["latency_s"] for f in failures]
        right = sum(f["right_rank"] for f in failures)
        rows.append(row("nblaunch", "rank 3 (node 1) raises in a collective: until the call raises", "s", latencies,
                        goal=f"<= {GOAL_FAILURE_S:g} s, right rank every time",
                        met=all(v is not None and v <= GOAL_FAILURE_S for v in latencies) and right == len(failures)))
        notes.append(f"failure: the right rank (3) named first in {right} of {len(failures)}")
        # Ray Train last: what its fit() leaves running must not slow the others down.
        nblaunch.preloaded().release()  # the kept nodes hold the CPUs it needs
        train = [timed("Ray Train", _ray_train_fit)() for _ in range(max(2, rounds // 3))] if have_train else []
        if train:
            ratios["vs Ray Train (run after)"] = pair_ratios(first, train)
            launch_rows.append(row("Ray Train", "TorchTrainer.fit(), 4 workers (run after the others)", "s", train))
        rows[:0] = [row("nblaunch", "launch onto the running cluster, the nodes the last launch kept: 4 ranks import "
                        "torch, group, all_reduce", "s", kept_launches, goal=f"<= {GOAL_FIRST_S:g} s",
                        met=bool(kept_launches) and sorted(kept_launches)[len(kept_launches) // 2] <= GOAL_FIRST_S,
                        ratios={"vs raw Ray": pair_ratios(kept_launches, samples["raw Ray"])}),
                    row("nblaunch", "the same, the first launch onto the cluster (placing the nodes)", "s", first,
                        ratios=ratios)] + launch_rows
        for impl, counts in left.items():
            notes.append(f"{impl}: live actors + placement groups left after each launch: max {max(counts)} "
                         f"over {len(counts)} launches")
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"rows": rows, "notes": notes}
