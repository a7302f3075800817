"""Collectives, process helpers and metric logging in a real 2-process launch."""

import os

import pytest
import torch

from nblaunch.training import Accelerator
from nblaunch.training.runtime.collectives import ShapeMismatchError


def _collectives(tmp):
    acc = Accelerator()
    r = acc.process_index
    out = {"state": (acc.process_index, acc.local_process_index, acc.num_processes,
                     str(acc.device), acc.is_main_process, acc.is_local_main_process,
                     acc.distributed_type.value)}
    out["gather"] = acc.gather(torch.tensor([r, r])).tolist()
    out["gather_scalar"] = acc.gather(torch.tensor(float(r))).tolist()
    out["gather_nested"] = {k: v.tolist() for k, v in acc.gather({"a": torch.tensor([r])}).items()}
    try:
        acc.gather(torch.zeros(2 + r, 3))
        out["mismatch"] = None
    except ShapeMismatchError as e:
        out["mismatch"] = str(e)
    # reduce aborted the rank inside gloo, broadcast copied the wrong bytes silently: both now
    # raise on every rank, naming the shapes, and the group stays usable.
    for name, call in (("reduce", lambda: acc.reduce(torch.zeros(2, 1 + r))),
                       ("broadcast", lambda: acc.broadcast(torch.zeros(3 + r)))):
        try:
            call()
            out[name + "_mismatch"] = None
        except ShapeMismatchError as e:
            out[name + "_mismatch"] = str(e)
    out["gather_object"] = acc.gather_object([f"r{r}"])
    out["sum"] = acc.reduce(torch.tensor([1.0 + r])).tolist()
    out["mean"] = acc.reduce(torch.tensor([1.0 + r]), "mean").tolist()
    out["pad"] = acc.pad_across_processes(torch.ones(2 + r, dtype=torch.long)).tolist()
    out["pad_first"] = acc.pad_across_processes(torch.ones(1, 2 + r), dim=1, pad_first=True).tolist()
    out["broadcast"] = acc.broadcast(torch.tensor([r * 10])).tolist()
    with acc.split_between_processes(list("abcde")) as part:
        out["split"] = part
    with acc.split_between_processes(torch.arange(5), apply_padding=True) as part:
        out["split_padded"] = part.tolist()
    with acc.split_between_processes({"x": list("abc"), "y": torch.arange(3)}, apply_padding=True) as part:
        out["split_dict"] = {"x": part["x"], "y": part["y"].tolist()}
    import datasets  # a Hugging Face Dataset stays one, and splits by rows (not by columns)
    table = datasets.Dataset.from_list([{"k": v} for v in range(5)])
    with acc.split_between_processes(table, apply_padding=True) as part:
        out["split_dataset"] = (type(part).__name__, part["k"])
    marker = os.path.join(tmp, "main-was-first")
    with acc.main_process_first():
        out["marker_seen"] = os.path.exists(marker)
        if acc.is_main_process:
            open(marker, "w").close()
    acc.wait_for_everyone()
    acc.print(f"printed by rank {r}")
    if r == 1:
        acc.set_trigger()
    out["trigger"] = acc.check_trigger()
    acc.log({"loss": torch.tensor(0.5 + r), "acc": 1}, step=3)
    # Each RNG starts different on each rank, then every rank draws rank 0's numbers.
    from nblaunch.utils import synchronize_rng_states
    torch.manual_seed(100 + r)
    generator = torch.Generator().manual_seed(200 + r)
    synchronize_rng_states(["torch", "generator", "cuda"], generator)
    out["rng"] = (torch.rand(2).tolist(), torch.rand(2, generator=generator).tolist())
    return out


def test_collectives_in_two_processes(recorder, tmp_path):
    from nblaunch.events import Metrics
    from nblaunch.api import notebook_launcher

    r0, r1 = notebook_launcher(_collectives, args=(str(tmp_path),), num_processes=2, display=recorder)
    assert r0["state"] == (0, 0, 2, "cpu", True, True, "MULTI_CPU")
    assert r1["state"] == (1, 1, 2, "cpu", False, False, "MULTI_CPU")
    for r in (r0, r1):
        assert r["gather"] == [0, 0, 1, 1]
        assert r["gather_scalar"] == [0.0, 1.0]
        assert r["gather_nested"] == {"a": [0, 1]}
        assert "rank 0: shape (2, 3)" in r["mismatch"] and "rank 1: shape (3, 3)" in r["mismatch"]
        assert "reduce" in r["reduce_mismatch"] and "rank 1: shape (2, 2)" in r["reduce_mismatch"]
        assert "broadcast" in r["broadcast_mismatch"] and "rank 0: shape (3,)" in r["broadcast_mismatch"]
        assert r["gather_object"] == ["r0", "r1"]
        assert r["sum"] == [3.0] and r["mean"] == [1.5]
        assert r["broadcast"] == [0]
        assert r["trigger"] is True
        assert r["rng"] == (torch.rand(2, generator=torch.Generator().manual_seed(100)).tolist(),
                            torch.rand(2, generator=torch.Generator().manual_seed(200)).tolist())
    assert r0["pad"] == [1, 1, 0] and r1["pad"] == [1, 1, 1]
    assert r0["pad_first"] == [[0, 1, 1]] and r1["pad_first"] == [[1, 1, 1]]
    assert r0["split"] == ["a", "b", "c"] and r1["split"] == ["d", "e"]
    assert r0["split_padded"] == [0, 1, 2] and r1["split_padded"] == [3, 4, 4]
    assert r0["split_dict"] == {"x": ["a", "b"], "y": [0, 1]} and r1["split_dict"] == {"x": ["c", "c"], "y": [2, 2]}
    assert r0["split_dataset"] == ("Dataset", [0, 1, 2]) and r1["split_dataset"] == ("Dataset", [3, 4, 4])
    assert r0["marker_seen"] is False and r1["marker_seen"] is True
    # (torch 2.9's gloo says "[Gloo] Rank N is connected to ..." on its own: not ours to judge.)
    printed = {rank: [line for line in recorder.lines(rank) if not line.startswith("[Gloo]")] for rank in (0, 1)}
    assert printed == {0: ["printed by rank 0"], 1: []}
    metrics = sorted((m.rank, m.values["loss"], m.values["acc"], m.step) for m in recorder.of(Metrics))
    assert metrics == [(0, 0.5, 1, 3), (1, 1.5, 1, 3)]


def test_single_process_collectives_are_identity():
    acc = Accelerator()
    t = torch.arange(3)
    assert acc.gather(t) is t and acc.gather_object(["x"]) == ["x"]
    assert acc.reduce(t, "mean").tolist() == [0, 1, 2]
    assert acc.pad_across_processes(t) is t
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    acc.log({"loss": 1.0})  # outside a launch: nothing happens, nothing fails
    with pytest.raises(ValueError, match="reduction"):
        acc.reduce(t, "median")
