"""Issue 44: ranks started ahead of the next launch wait on standby (on a GPU: CUDA ready; here,
with ``NBLAUNCH_STANDBY=always``, on the CPU), visible, released on demand, let go when a launch
asks for another shape, replaced when one died, never handed a launch once gone; and a launch
never sees another's Python state."""

from __future__ import annotations

import pytest

from warm_start_helpers import Installed, run

pytestmark = pytest.mark.slow


@pytest.fixture
def installed():
    made = Installed()
    yield made
    made.clean()


CLAIMED = """
    import signal

    def who(package):
        found = package in sys.modules
        __import__(package)
        return os.getpid(), found

    from nblaunch.events import RankStarted

    class Rows:  # a display that keeps how each rank began (its row shows it)
        began = {}
        def on_event(self, event):
            if isinstance(event, RankStarted):
                self.began[event.rank] = event.began
        def close(self):
            pass

    launch(who, PACKAGE, n=2, method="spawn")
    waiting = [r.pid for r in nblaunch.warm_start(wait=120).waiting]
    rows = Rows()
    claimed = notebook_launcher(who, args=(PACKAGE,), num_processes=2, start_method="spawn", display=rows)
    nblaunch.warm_start(wait=120)
    again = [r.pid for r in nblaunch.warm_start().waiting]
    os.kill(again[1], signal.SIGKILL)  # one dies while it waits
    replaced = launch(who, PACKAGE, n=2, method="spawn")
    nblaunch.warm_start(wait=120)
    before_other_shape = [r.pid for r in nblaunch.warm_start().waiting]
    three = launch(who, PACKAGE, n=3, method="spawn")  # another shape: they are let go first
    gone_after_other_shape = [pid for pid in before_other_shape if os.path.exists(f"/proc/{pid}")]
    ready = nblaunch.warm_start(wait=120)
    waiting_three = [r.pid for r in ready.waiting]
    released = ready.release()
    left = nblaunch.warm_start()
    say(waiting=waiting, claimed=claimed, again=again, replaced=replaced, three=three,
        still_there=gone_after_other_shape, waiting_three=waiting_three, released=released,
        left=[r.pid for r in left.waiting], alive_after_release=[p for p in waiting_three if os.path.exists(f"/proc/{p}")],
        shown=repr(ready), began=rows.began)
"""


def test_ranks_waiting_on_standby_are_claimed_replaced_let_go_and_released(installed, tmp_path):
    package = installed.package("VALUE = 1\n")
    [said], _ = run(CLAIMED, setup=f"PACKAGE = {package!r}", cwd=str(tmp_path), NBLAUNCH_STANDBY="always")
    assert len(said["waiting"]) == 2
    assert [pid for pid, _ in said["claimed"]] == said["waiting"]  # the launch took the waiting ranks
    assert all(loaded for _, loaded in said["claimed"])  # forked after the package was loaded ahead
    replaced = [pid for pid, _ in said["replaced"]]
    assert replaced[0] == said["again"][0] and replaced[1] != said["again"][1]  # the dead one was not handed it
    assert len({pid for pid, _ in said["three"]} & set(said["waiting"] + said["again"])) == 0
    assert said["still_there"] == []  # let go, and gone, before the 3-rank launch started
    assert len(said["waiting_three"]) == 3 and said["released"] == 3
    assert said["left"] == [] and said["alive_after_release"] == []
    assert "rank 2 waits on the CPU" in said["shown"]
    assert all(said["began"][r].startswith("warm: waited on the CPU since ") for r in ("0", "1")), said["began"]


def test_no_rank_waits_when_standby_is_turned_off_and_none_on_the_cpu_by_default(tmp_path):
    script = """
        launch(os.getpid, n=2, method="spawn")
        off = nblaunch.warm_start(wait=120)
        say(waiting=len(off.waiting), shown=repr(off))
    """
    for setting, shown in (("0", "NBLAUNCH_STANDBY=0"), ("auto", "NBLAUNCH_STANDBY=auto")):
        [said], _ = run(script, cwd=str(tmp_path), NBLAUNCH_STANDBY=setting)
        assert said["waiting"] == 0 and shown in said["shown"]


FRESH = """
    import torch.distributed as dist

    def leave_state_behind(package, precision):
        module = __import__(package)
        seen = {"counter": module.counter, "group": dist.is_initialized(), "precision": None}
        module.counter += 1
        from nblaunch import Accelerator, AcceleratorState
        seen["state"] = bool(AcceleratorState._shared_state)
        accelerator = Accelerator(mixed_precision=precision, cpu=True)
        dist.barrier()
        seen["precision"] = accelerator.mixed_precision
        globals()["left_over"] = "from an earlier launch"
        return seen, os.getpid()

    runs = []
    for precision in ("bf16", "no", "bf16"):
        runs.append(launch(leave_state_behind, PACKAGE, precision, n=2, method=METHOD))
        nblaunch.warm_start(wait=120)
    say(runs=runs)
"""


@pytest.mark.parametrize("method", [None, "spawn"])
def test_a_launch_never_sees_another_launchs_python_state(method, installed, tmp_path):
    package = installed.package("counter = 0\n")
    [said], _ = run(FRESH, setup=f"PACKAGE, METHOD = {package!r}, {method!r}", cwd=str(tmp_path),
                    NBLAUNCH_STANDBY="always")
    seen = [s for run_ in said["runs"] for s, _ in run_]
    assert [s["counter"] for s in seen] == [0] * 6  # fresh module globals
    assert not any(s["group"] or s["state"] for s in seen)  # no process group, no Accelerator state
    assert [s["precision"] for s in seen] == ["bf16"] * 2 + ["no"] * 2 + ["bf16"] * 2
    assert len({pid for run_ in said["runs"] for _, pid in run_}) == 6  # a fresh process each time
