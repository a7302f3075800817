"""``nblaunch env``: what a bug report needs, as a list to paste: versions, devices, the
start method a launch here would use, and why, and where its ranks keep compiled code."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

from nblaunch.contract.version import __version__
from nblaunch.contract.variables import TORCHINDUCTOR_CACHE_DIR
from nblaunch.launch.planning import devices, tpu
from nblaunch.launch.planning.compile_cache import compile_cache_environ
from nblaunch.launch.planning.plan import start_method_for


def add_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("env", help="print versions and devices for a bug report",
                        description="Versions of Python, torch, CUDA/NCCL or XLA, the notebook stack and "
                                    "Accelerate, the devices, and the start method a launch would use.")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> list[tuple[str, str]]:
    """(name, value) pairs, in the order they are printed."""
    import torch  # deferred: a second to import; `nblaunch env --help` needs none of it

    rows = [("nblaunch", __version__), ("Python", sys.version.split()[0]),
            ("Platform", platform.platform()), ("CPU cores", str(os.cpu_count())),
            ("torch", torch.__version__)]
    gpus = devices.cuda_device_count()
    if torch.version.cuda:
        rows.append(("CUDA (torch built with)", torch.version.cuda))
    if gpus:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
        rows += [("GPUs", f"{gpus}: {names}"), ("NCCL", nccl)]
    else:
        rows.append(("GPUs", "none visible"))
    rows.append(("torch_xla", _version("torch_xla")))
    if tpu.tpu_markers():
        rows.append(("TPU", "this host has TPU markers: launches use torch_xla"))
    for package in ("accelerate", "transformers", "ipywidgets", "ipykernel", "ipython", "cloudpickle", "ray"):
        rows.append((package, _version(package)))
    method, why = start_method_for(None, cpu=False)
    rows.append(("start method", f"{method}: {why}"))
    cache = compile_cache_environ().get(TORCHINDUCTOR_CACHE_DIR)
    rows.append(("torch.compile cache", cache or f"{os.environ.get(TORCHINDUCTOR_CACHE_DIR) or 'torch default'} (yours)"))
    return rows


def run(options: argparse.Namespace) -> int:
    print("Copy this into your bug report:\n")
    for name, value in report():
        print(f"- {name}: {value}")
    return 0
