"""Issue 31, item 7 (stretch): DeepSpeed ZeRO-2 and fp8 training on the GPU.

Neither trains here: nblaunch's Accelerator has neither (``deepspeed_plugin`` is refused, fp8 runs
only in Accelerate's own Accelerator with an fp8 backend), and the GPU machine carries neither
DeepSpeed nor an fp8 backend (torchao, Transformer Engine, MS-AMP), nor can it download one. What
is checked is that both are refused clearly, before any step, on the GPU.
"""

from __future__ import annotations

import importlib.util

import pytest

from gpu_common import GPU_MARKS
from nblaunch import LaunchConfigError, RankFailedError, notebook_launcher

pytestmark = GPU_MARKS

FP8_BACKENDS = ("transformer_engine", "torchao", "msamp")


def with_deepspeed_plugin() -> None:
    from nblaunch import Accelerator

    Accelerator(deepspeed_plugin={"zero_stage": 2})


def test_deepspeed_plugin_is_refused_in_the_rank_with_what_to_use():
    with pytest.raises(RankFailedError, match=r"deepspeed_plugin=\.\.\.\) is not supported by nblaunch"):
        notebook_launcher(with_deepspeed_plugin, num_processes=1, display="none", timeout=120)


@pytest.mark.skip(reason="DeepSpeed ZeRO-2 through deepspeed_plugin=: DeepSpeed is not on the GPU machine "
                         "(no registry there to install it) and nblaunch's Accelerator does not take the plugin")
def test_deepspeed_zero2_trains_on_one_gpu():
    pass


def test_fp8_without_a_backend_is_refused_before_anything_starts():
    if any(importlib.util.find_spec(name) for name in FP8_BACKENDS):
        pytest.skip("an fp8 backend is installed: the refusal does not apply (fp8 training is not built in this lane)")
    with pytest.raises(LaunchConfigError, match="mixed_precision='fp8' runs only with Hugging Face Accelerate's own"):
        notebook_launcher(with_deepspeed_plugin, num_processes=1, mixed_precision="fp8", display="none")


@pytest.mark.skip(reason="fp8 training through torchao's float8 on H100/H200: no fp8 backend on the GPU machine "
                         "(torchao would travel as a wheel matched to its torch 2.11), and nblaunch's Accelerator "
                         "has no fp8")
def test_fp8_trains_through_torchao_on_hopper():
    pass
