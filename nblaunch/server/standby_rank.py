"""A rank forked ahead of its launch, waiting for a launch to claim it, with what that launch
will need ready: on a GPU, CUDA's context and the libraries a training step uses (cuBLAS, cuDNN);
then, while it waits, the modules earlier ranks imported (``names``).

It gives back every block of GPU memory it allocated: it waits holding what the context holds.
It leaves as soon as its GPU's memory is wanted elsewhere, so it can never be why something else
runs out: a thread checks NVML every 50 ms, and it leaves when the GPU's used memory grows by
more than 64 MiB (another process, the kernel included, is allocating) or its free memory falls
under 1 GiB. On the CPU (``NBLAUNCH_STANDBY=always``) there is no device to ready or watch.

Its events pipe says ``STANDBY ("ready", facts)`` once the device is ready and ``("left",
why)`` if it leaves. A launch sends ``CLAIM`` on its control socket; the rank answers ``CLAIM``
once the package it is importing is done (an import cut short would leave half of a library
behind), and from then on it is an ordinary rank (``worker.bootstrap.main_spawned``) that never
leaves on its own. It imports with the variables of the rank it will be (``RANK``, ...; a library
may read them at import), which the launch that claims it sets alike.
"""

from __future__ import annotations

import os
import pickle
import select
import threading
import time

from nblaunch import wire
from nblaunch.facts import nvml
from nblaunch.server.loading import load_package, packages_in_order
from nblaunch.worker import lifeline

WATCH_EVERY_S = 0.05
GROWTH_LEFT_AT = 64 << 20  # bytes others may allocate on the GPU before the rank makes room
FREE_AT_LEAST = 1 << 30  # bytes the GPU must keep free while the rank waits
PROCESS_NAME = "nblaunch-wait"  # not a rank's name (lifeline.PROCESS_NAME_PREFIX) until claimed


def wait_for_a_launch(control: int, events: int, device: str, names: list[str], rank_environ: dict[str, str]) -> None:
    """Ready ``device`` ("cpu", or a CUDA index) and import ``names`` while waiting (with
    ``rank_environ`` set), until a launch claims this process (return), or the device's memory is
    wanted, the launcher is gone or readying failed (exit)."""
    lifeline.die_with_parent(os.getppid())
    lifeline.name_process(PROCESS_NAME)
    started = time.monotonic()
    try:
        watch = None if device == "cpu" else _ready_gpu(int(device))
    except Exception as error:  # noqa: BLE001  a GPU that cannot be readied waits for no one
        _say(events, "left", f"readying GPU {device} failed: {type(error).__name__}: {error}")
        os._exit(0)
    _say(events, "ready", {"device": device, "seconds": time.monotonic() - started, "pid": os.getpid(),
                           "held_mib": None if watch is None else watch.held_mib()})
    claimed = threading.Event()
    leaving = threading.Lock()  # the watch leaves, or the claim is answered: never both
    if watch is not None:
        threading.Thread(target=_watch, args=(watch, claimed, leaving, events), daemon=True).start()
    os.environ.update(rank_environ)
    for _, modules in packages_in_order(names):
        if select.select([control], [], [], 0)[0]:
            break  # claimed: the rest is the rank's to import
        load_package(modules, watch_threads=False)
    select.select([control], [], [])  # the claim
    with leaving:
        claimed.set()
    _answer_claim(control)


def _watch(watch: "_GpuWatch", claimed: threading.Event, leaving: threading.Lock, events: int) -> None:
    while not claimed.wait(WATCH_EVERY_S):
        why = watch.why_leave()
        if why is not None:
            with leaving:
                if claimed.is_set():
                    return
                _say(events, "left", why)
                os._exit(0)


def _answer_claim(control: int) -> None:
    head = os.read(control, wire.HEADER.size)
    if len(head) != wire.HEADER.size or wire.HEADER.unpack(head) != (wire.CLAIM, 0):
        os._exit(0)  # EOF (released, or the launcher is gone) or not a claim: nothing to wait for
    wire.write_frame(control, wire.CLAIM)


def _say(events: int, what: str, detail: object) -> None:
    try:
        wire.write_frame(events, wire.STANDBY, pickle.dumps((what, detail)))
    except OSError:
        os._exit(0)  # the launcher is gone


class _GpuWatch:
    """One GPU's memory through NVML, against what it used when the rank became ready."""

    def __init__(self, index: int, handle: tuple, used_before: int | None) -> None:
        self._nvml, self._handle = handle
        self._index = index
        self._used_before = used_before
        free, self._baseline, _ = self._read()
        if free < FREE_AT_LEAST:
            raise RuntimeError(f"GPU {index} has only {free >> 20} MiB free")

    def _read(self) -> tuple[int, int, int]:
        found = nvml.memory_info(self._nvml, self._handle)
        if found is None:
            raise RuntimeError("NVML stopped answering")
        return found

    def held_mib(self) -> int | None:
        return None if self._used_before is None else max(0, self._baseline - self._used_before) >> 20

    def why_leave(self) -> str | None:
        try:
            free, used, _ = self._read()
        except RuntimeError as error:
            return str(error)
        self._baseline = min(self._baseline, used)  # a rank that was still leaving freed its memory
        if used - self._baseline > GROWTH_LEFT_AT:
            return f"GPU {self._index}'s memory was wanted: {(used - self._baseline) >> 20} MiB more in use"
        if free < FREE_AT_LEAST:
            return f"GPU {self._index}'s memory was wanted: {free >> 20} MiB free"
        return None


def _ready_gpu(index: int) -> _GpuWatch:
    import torch  # deferred: only GPU ranks on standby need it (the server imported it: no cost)

    handle = _nvml_handle(torch.cuda.get_device_properties(index), index)
    used_before = nvml.memory_info(*handle)
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    square = torch.ones(64, 64, device=device)
    square @ square  # cuBLAS's handle and workspace
    half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    square.to(half) @ square.to(half)  # the half-precision GEMMs autocast runs
    image = torch.ones(1, 1, 8, 8, device=device)
    torch.nn.functional.conv2d(image, torch.ones(1, 1, 3, 3, device=device))  # cuDNN
    torch.cuda.synchronize(device)
    del square, image
    torch.cuda.empty_cache()  # what the allocator kept goes back: only the context stays
    return _GpuWatch(index, handle, None if used_before is None else used_before[1])


def _nvml_handle(properties: object, index: int) -> tuple:
    """(NVML, the handle of CUDA's GPU ``index``): by its UUID, else its PCI address, else (one
    GPU in all) the only one."""
    opened = nvml.open_nvml()
    if opened is None:
        raise RuntimeError("NVML cannot be opened: the GPU's memory could not be watched")
    library, handles = opened
    uuid = str(getattr(properties, "uuid", ""))
    handle = nvml.handle_by_uuid(library, uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid) if uuid else None
    if handle is None and hasattr(properties, "pci_bus_id"):
        address = f"{getattr(properties, 'pci_domain_id', 0):08x}:{properties.pci_bus_id:02x}:" \
                  f"{getattr(properties, 'pci_device_id', 0):02x}.0"
        handle = nvml.handle_by_pci_bus_id(library, address)
    if handle is None and len(handles) == 1:
        handle = handles[0]
    if handle is None:
        raise RuntimeError(f"NVML does not know CUDA's GPU {index} ({uuid or 'no UUID'})")
    return library, handle
