"""The GPU lane's report (tools/gpu_lane.sh): the machine, the versions, each numbered item of issue
31 (and item 8, issues 44 and 60: ranks begin with their imports) with its tests' outcomes and numbers, and
the benchmark table.

``python tools/gpu_report.py versions OUT`` writes OUT/versions.json (no CUDA is initialised: the
GPU is named by nvidia-smi and NVML); ``python tools/gpu_report.py report OUT`` reads it, OUT/junit.xml
(pytest's, with the numbers tests recorded through ``record_property``) and OUT/benchmark.md, and
writes OUT/report.md.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

ITEMS = {
    1: "A kernel that already initialised CUDA launches (nbclient, real ipykernel): spawn chosen and said in "
       "one line, never a CUDA initialization error; the same for %%distributed",
    2: "One GPU rank as a real launch: placement of model, optimizer state and batches; NCCL group; gather, "
       "reduce, broadcast, pad_across_processes on CUDA tensors",
    3: "Mixed precision: fp16 with GradScaler (inf step skipped, scaler in checkpoints), bf16 autocast; "
       "weights against Accelerate's Accelerator on the same loop",
    4: "FSDP on CUDA (world size 1) with a mixed-precision policy and a DCP checkpoint",
    5: "A tiny transformers.Trainer on the GPU under notebook_launcher, mixed_precision='bf16' reaching it",
    6: "2 ranks on one GPU refused clearly; CPU ranks (cpu=True) on a GPU machine with gloo, CUDA untouched",
    7: "Stretch: DeepSpeed ZeRO-2, fp8 through torchao",
    8: "Issues 44 and 60, ranks begin with their imports: the launch server up before the first launch; the "
       "first launch's rank finds what the function imports loaded, and every later one; GPU memory freed and "
       "mixed precision changed between launches; a library that starts CUDA never imported where ranks are "
       "forked from (the server replaced without it, a CUDA-clean kernel untouched)",
}


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def versions() -> dict:
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
            "cores": os.cpu_count()}
    for name in ("torch", "accelerate", "transformers", "nblaunch", "ipykernel", "nbclient", "ipywidgets"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    if info["nblaunch"] is None:  # from the source tree (the editable install failed): its own number
        try:
            import nblaunch

            info["nblaunch"] = f"{nblaunch.__version__} (source tree)"
        except ImportError:
            pass
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
    except Exception as error:  # noqa: BLE001  (the report says what went wrong instead)
        info["torch_error"] = repr(error)
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    info["gpus"] = [line.strip() for line in smi.splitlines() if line.strip()]
    info["commit"] = _run(["git", "rev-parse", "--short", "HEAD"]) or None
    return info


def _cases(junit_path: str) -> list[dict]:
    if not os.path.exists(junit_path):
        return []
    cases = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[kind]
                message = (node.get("message") or node.text or "").strip()
                break
        match = re.search(r"test_gpu_(\d+)_", case.get("classname", "") + " " + case.get("file", ""))
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append({"item": int(match.group(1)) if match else 0, "name": case.get("name"),
                      "seconds": float(case.get("time") or 0), "outcome": outcome, "message": message,
                      "properties": props})
    return cases


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " ..."


def report(out: str) -> str:
    with open(os.path.join(out, "versions.json")) as f:
        info = json.load(f)
    cases = _cases(os.path.join(out, "junit.xml"))
    status = {}
    if os.path.exists(os.path.join(out, "status.json")):
        with open(os.path.join(out, "status.json")) as f:
            status = json.load(f)
    gpus = info.get("gpus") or []
    no_cuda = not gpus or info.get("torch_cuda") is None
    lines = ["# nblaunch GPU lane (issues 31 and 44)", ""]
    if no_cuda:
        why = "torch is built without CUDA" if info.get("torch_cuda") is None else "nvidia-smi lists no GPU"
        lines += [f"**no CUDA device** ({why}): the GPU tests were skipped and nothing was measured.", ""]
    lines += [
        f"- date: {info['date']}; command: `bash tools/gpu_lane.sh`; lane time {status.get('seconds', '?')} s",
        f"- machine: {'; '.join(gpus) or 'no NVIDIA GPU'} (name, driver, memory); {info['cores']} CPU cores; "
        f"{info['platform']}",
        f"- versions: Python {info['python']}, torch {info.get('torch')} (CUDA {info.get('torch_cuda')}, NCCL "
        f"{info.get('nccl')}), accelerate {info.get('accelerate')}, transformers {info.get('transformers')}, "
        f"nblaunch {info.get('nblaunch')} (commit {info.get('commit') or 'unknown'}), ipykernel "
        f"{info.get('ipykernel')}, nbclient {info.get('nbclient')}, ipywidgets {info.get('ipywidgets')}",
    ]
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "FAILED", "ERROR", "skipped")}
    lines += [f"- tests/gpu: {counts['passed']} passed, {counts['FAILED']} failed, {counts['ERROR']} errors, "
              f"{counts['skipped']} skipped (pytest exit code {status.get('pytest_exit', '?')})", ""]
    for item, title in ITEMS.items():
        mine = [c for c in cases if c["item"] == item]
        if not mine:
            verdict = "not run"
        elif any(c["outcome"] in ("FAILED", "ERROR") for c in mine):
            verdict = "**FAIL**"
        elif all(c["outcome"] == "skipped" for c in mine):
            verdict = "skipped"
        else:
            verdict = "PASS" + (" (some skipped)" if any(c["outcome"] == "skipped" for c in mine) else "")
        lines += [f"## {item}. {title}: {verdict}", "", "| test | outcome | s | numbers / why |", "|---|---|---|---|"]
        for c in mine:
            numbers = "; ".join(f"{k} = {v}" for k, v in c["properties"].items())
            why = _one_line(c["message"], 600) if c["outcome"] != "passed" else ""
            detail = " ".join(x for x in (numbers, why) if x).replace("|", "\\|")
            lines.append(f"| {c['name']} | {c['outcome']} | {c['seconds']:.1f} | {detail} |")
        lines.append("")
    bench = os.path.join(out, "benchmark.md")
    lines += ["## Benchmark (`python -m benchmarks gpu`)", ""]
    if os.path.exists(bench):
        with open(bench) as f:
            text = f.read()
        lines += [text.split("\n", 1)[1].strip() if text.startswith("# ") else text.strip()]
    else:
        lines += [f"not run: {status.get('benchmark', 'no benchmark.md')}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("versions", "report"):
        print("usage: python tools/gpu_report.py versions|report OUT", file=sys.stderr)
        return 2
    what, out = argv
    if what == "versions":
        with open(os.path.join(out, "versions.json"), "w") as f:
            json.dump(versions(), f, indent=1)
    else:
        with open(os.path.join(out, "report.md"), "w") as f:
            f.write(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
