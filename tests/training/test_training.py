"""Training equivalence, gradient accumulation and mixed precision, in real 2-process launches."""

import importlib.util
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nblaunch.contract.precision import fast_precision
from nblaunch.training import Accelerator, set_seed
from nblaunch.training.precision.modes import check_supported, resolve_mixed_precision


def _data(n=48):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 2, generator=g) + 0.1 * torch.randn(n, 2, generator=g)
    return TensorDataset(x, y)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(batch_size, accumulation=1, epochs=2, mixed_precision="no", lr=0.1):
    set_seed(0)
    # One scheduler step per optimizer step: then 2 x b trains exactly like 1 x 2b.
    acc = Accelerator(gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision,
                      step_scheduler_per_process=False)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loader = DataLoader(_data(), batch_size=batch_size, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
    weights = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return {"weights": weights, "losses": losses, "lr": sched.get_last_lr()[0],
            "type": acc.distributed_type.value, "ddp": type(model).__name__}


def _close(a, b, tol=1e-5):
    return all(torch.allclose(x, y, atol=tol, rtol=0) for x, y in zip(a, b))


def _accumulate_grads():
    """Local gradients differ between ranks on non-sync micro-steps, agree after the sync."""
    acc = Accelerator(gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(_data(16), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    out = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            out.append((acc.sync_gradients, model.module[0].weight.grad.clone()))
            opt.step()
            opt.zero_grad()
    return out


@pytest.fixture(scope="module")
def runs(launch):
    def both():
        return {"ddp": train(4), "accum": _accumulate_grads()}
    return launch(both)


def test_two_processes_equal_one_process_with_double_batch(runs):
    single = train(8)
    for r in runs:
        assert r["ddp"]["type"] == "MULTI_CPU" and r["ddp"]["ddp"] == "DistributedDataParallel"
        assert _close(r["ddp"]["weights"], single["weights"])
        assert r["ddp"]["lr"] == pytest.approx(single["lr"])
    # the run really trained
    assert not _close(single["weights"], [p.detach() for p in _model().parameters()], tol=1e-3)


def test_accumulation_equals_two_processes(runs):
    accumulated = train(4, accumulation=2)
    assert accumulated["type"] == "NO"
    assert _close(runs[0]["ddp"]["weights"], accumulated["weights"])
    assert accumulated["lr"] == pytest.approx(runs[0]["ddp"]["lr"])


def test_accumulate_syncs_only_on_sync_steps(runs):
    r0, r1 = runs[0]["accum"], runs[1]["accum"]
    assert [s for s, _ in r0] == [False, True]  # 16 samples / (2 x 4) = 2 micro-steps per rank
    (_, g0_local), (_, g0_sync) = r0
    (_, g1_local), (_, g1_sync) = r1
    assert not torch.allclose(g0_local, g1_local)
    assert torch.allclose(g0_sync, g1_sync)


def test_accumulate_forces_sync_at_end_of_dataloader():
    # 5 batches with 2 accumulation steps: the last (odd) batch must still step.
    acc = Accelerator(gradient_accumulation_steps=2)
    loader = acc.prepare(DataLoader(list(range(10)), batch_size=2))
    flags = []
    for _ in loader:
        with acc.accumulate():
            flags.append(acc.sync_gradients)
    assert flags == [False, True, False, True, True]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cpu(launch, precision):
    def run():
        acc = Accelerator()  # the mode comes from the launcher through NBLAUNCH_MIXED_PRECISION
        r = train(4, epochs=3, mixed_precision=None, lr=0.05)
        return acc.mixed_precision, r["losses"], acc.scaler is not None
    from nblaunch.api import notebook_launcher
    results = notebook_launcher(run, num_processes=2, mixed_precision=precision, display="none")
    for mode, losses, has_scaler in results:
        assert mode == precision
        assert has_scaler == (precision == "fp16")
        assert all(math.isfinite(v) for v in losses)
        assert sum(losses[-4:]) < 0.5 * sum(losses[:4])


def test_autocast_wraps_forward_and_returns_fp32():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.update(dtype=o.dtype))
    out = model(torch.randn(2, 4))
    assert seen["dtype"] == torch.bfloat16 and out.dtype == torch.float32
    with acc.autocast():
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(torch.randn(2, 4)).dtype == torch.float32 and "forward" not in plain.__dict__


def test_fp16_overflow_skips_step_and_scheduler():
    acc = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(1, 2)).sum() * float("inf")
    acc.backward(loss)
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    assert not math.isfinite(norm)
    assert acc.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sched.get_last_lr() == [0.1]
    # a finite step goes through, and the scheduler advances
    acc.backward(model(torch.ones(1, 2)).sum())
    opt.step()
    sched.step()
    assert not acc.optimizer_step_was_skipped
    assert sched.get_last_lr() == [0.05]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_mixed_precision_setting_rules(monkeypatch):
    monkeypatch.setenv("NBLAUNCH_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"
    assert Accelerator(mixed_precision="no").mixed_precision == "no"  # explicit wins
    monkeypatch.setenv("NBLAUNCH_MIXED_PRECISION", "fp8")
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(ImportError, match=r'pip install "nblaunch\[fp8\]"'):
            Accelerator()
    else:
        with pytest.warns(UserWarning, match="fp8' on the CPU: torchao emulates"):
            assert Accelerator().mixed_precision == "fp8"
    with pytest.raises(ValueError, match="mixed_precision"):
        Accelerator(mixed_precision="fp12")
    monkeypatch.setenv("NBLAUNCH_MIXED_PRECISION", "auto")  # what the CPU computes fast: here none
    assert Accelerator().mixed_precision == Accelerator(mixed_precision="AUTO").mixed_precision == fast_precision("cpu")


@pytest.mark.parametrize("capability, fast", [((7, 5), "fp16"), ((8, 6), "bf16")])
def test_auto_on_a_gpu_is_what_its_capability_computes_fast(monkeypatch, capability, fast):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_mixed_precision("auto", torch.device("cuda", 0)) == fast


def test_bf16_on_a_gpu_that_only_emulates_it_warns_with_what_to_use(monkeypatch):
    # A T4: torch says bf16 is supported (emulation counts), but not in hardware.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.warns(UserWarning, match=r"'bf16' on Tesla T4 \(compute capability 7.5\) is emulated.*'fp16', or 'auto'"):
        check_supported("bf16", torch.device("cuda", 0))


def test_prepare_keeps_order_and_is_idempotent():
    acc = Accelerator()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = DataLoader(list(range(4)), batch_size=2)
    out = acc.prepare(loader, sched, "other", model, opt)
    assert [type(o).__name__ for o in out] == ["PreparedDataLoader", "AcceleratedScheduler", "str",
                                               "Linear", "AcceleratedOptimizer"]
    assert out[1].optimizers == [out[4]]
    again = acc.prepare(*out)
    assert all(a is b for a, b in zip(out, again))
    assert acc.prepare(opt) is out[4] and acc.prepare(model) is out[3]
    assert len(acc._optimizers) == 1 and len(acc._models) == 1 and len(acc._dataloaders) == 1


def _frozen_and_twice():
    acc = Accelerator()
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    model = acc.prepare(torch.nn.Linear(2, 2))
    return type(acc.prepare(frozen)).__name__, acc.prepare(model) is model


def test_ddp_only_for_trainable_models(launch):
    assert launch(_frozen_and_twice) == [("Linear", True)] * 2


def test_an_accelerator_let_go_frees_what_it_prepared():
    """The stop at a common step and resume= hook into each Accelerator as it is made: a kernel that
    drops its Accelerator and model must get their memory back (a GPU's, on a real device)."""
    import gc
    import weakref

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    held = weakref.ref(accelerator), weakref.ref(model)
    del accelerator, model
    gc.collect()
    assert [ref() for ref in held] == [None, None]
