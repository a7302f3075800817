"""A failed rank's frames, kept and rebuilt here as real frames (what %debug walks; the kernel
test is tests/warm/test_debugging.py): names, lines and locals as the rank had them, a value that
cannot cross stood in for, and the failure's locals block."""

from __future__ import annotations

import os
import pickle
import traceback

import pytest
import torch

from nblaunch import RankFailedError, notebook_launcher
from nblaunch.contract.kept_frames import KeptValue
from nblaunch.launch.post_mortem import rebuilt


class _NoDevice(torch.Tensor):
    @property
    def device(self):
        raise RuntimeError("a tensor subclass that cannot say its device")


def _inner(x, scale):
    elsewhere = torch.zeros(2, 3, device="meta")  # stands in for a GPU tensor: never crosses
    untouchable = open(os.devnull)  # an open file is never read to be sent
    hostile = torch.Tensor._make_subclass(_NoDevice, torch.zeros(2))  # noqa: F841  a local: looking at it raises
    if os.environ["RANK"] == "1":
        raise KeyError("shape mismatch")
    untouchable.close()
    return elsewhere


def _failing():
    x = torch.arange(15.0).reshape(3, 5)
    return _inner(x, 0.5)


# Spawned too: a fresh interpreter's first look at a value may import (a meta tensor's mean
# imported torch._dynamo, 2 s), and the launcher waits 1 s for a failed rank's whole report.
@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_the_failing_ranks_frames_come_back_as_real_frames_with_their_locals(start_method):
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(_failing, num_processes=2, display="none", start_method=start_method)
    [failure] = caught.value.failures
    assert [f.function for f in failure.frames] == ["_failing", "_inner"]
    # Under the failing line, before the exception's: the locals block.
    assert '    raise KeyError("shape mismatch")\n    locals:\n      x            Tensor[3, 5] float32 cpu\n' in failure.traceback
    assert failure.traceback.rstrip().endswith("KeyError: 'shape mismatch'")

    error, head = rebuilt(pickle.loads(pickle.dumps(failure)))  # as it crossed from the rank
    assert isinstance(error, KeyError) and error is not failure.exception  # a copy: the shown one is untouched
    walked = traceback.extract_tb(error.__traceback__)
    assert [(w.name, w.lineno) for w in walked] == [(f.function, f.lineno) for f in failure.frames]
    assert walked[-1].line == 'raise KeyError("shape mismatch")'  # this file's source, at the rank's line
    innermost = error.__traceback__.tb_next.tb_frame
    assert torch.equal(innermost.f_locals["x"], torch.arange(15.0).reshape(3, 5))
    assert innermost.f_locals["scale"] == 0.5
    stood_in = innermost.f_locals["elsewhere"]
    assert isinstance(stood_in, KeptValue) and stood_in.shape == torch.Size([2, 3]) and str(stood_in.device) == "meta"
    assert "TextIOWrapper" in repr(innermost.f_locals["untouchable"])
    assert isinstance(innermost.f_locals["hostile"], KeptValue)  # named, and the report still came
    assert innermost.f_globals["torch"] is torch  # this module's globals, copied
    assert head.tb_next is error.__traceback__
