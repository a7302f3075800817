"""``nblaunch.utils`` names that Accelerate's ``accelerate.utils`` has: ``save``, ``tqdm``,
``wait_for_everyone``, in real ranks."""

from __future__ import annotations

import os

import pytest
import torch

from nblaunch import notebook_launcher
from nblaunch.events import Progress


def helpers(folder):
    from nblaunch import Accelerator
    from nblaunch.utils import save, tqdm, wait_for_everyone

    rank = int(os.environ["RANK"])
    shown = [tqdm(range(3), desc="main only"), tqdm(range(3), desc="every rank", main_process_only=False)]
    disabled = [bar.disable for bar in shown]  # before the loops: a closed bar says disabled
    for bar in shown:
        for _ in bar:
            pass
    weights = {"w": torch.arange(4.0).reshape(2, 2), "b": torch.ones(2)}
    save(weights, os.path.join(folder, f"torch_from_{rank}.bin"))
    save(weights, os.path.join(folder, f"safe_from_{rank}.safetensors"), safe_serialization=True)
    Accelerator().save(weights, os.path.join(folder, f"accelerator_from_{rank}.safetensors"), safe_serialization=True)
    try:
        save([1, 2], os.path.join(folder, "not_a_state_dict"), safe_serialization=True)
        refused = None
    except TypeError as error:
        refused = str(error)
    wait_for_everyone()  # rank 0 has written by now
    return disabled, sorted(os.listdir(folder)), refused


def test_save_tqdm_and_wait_for_everyone_act_as_accelerates(tmp_path, recorder):
    safetensors = pytest.importorskip("safetensors.torch")
    results = notebook_launcher(helpers, args=(str(tmp_path),), num_processes=2, display=recorder)
    assert [r[0] for r in results] == [[False, False], [True, False]]  # one bar per machine, unless asked
    written = ["accelerator_from_0.safetensors", "safe_from_0.safetensors", "torch_from_0.bin"]
    assert results[0][1] == results[1][1] == written  # the main process writes; the others waited for it
    assert results[0][2].startswith("safe_serialization=True saves a dict of tensors")
    for name in written:
        loaded = (torch.load if name.endswith(".bin") else safetensors.load_file)(str(tmp_path / name))
        assert torch.equal(loaded["w"], torch.arange(4.0).reshape(2, 2))
    bars = {(e.rank, e.desc) for e in recorder.of(Progress)}
    assert bars == {(0, "main only"), (0, "every rank"), (1, "every rank")}
