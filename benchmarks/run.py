"""Run nblaunch's benchmarks: ``python -m benchmarks [--quick] [NAME ...]``.

Each measurement runs in a subprocess of its own with a hard time limit (its process group is
killed past it), so one failure or hang does not poison the others. Results go to
``benchmarks/results/latest.json`` and ``latest.md`` (or ``--out DIR``).

Measurements: launch, ddp, loader, memory, failure, output, warm, ray, fsdp, gpu, slurm, rerun, sweep, compile,
split, stop (default: all).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name: (module:function, title, time limit in seconds)
MEASUREMENTS = {
    "launch": ("benchmarks.m_launch:run", "1. Launch latency and time to the first training step (2 processes)", 420),
    "ddp": ("benchmarks.m_train:run_training", "2. DDP steps/s, small MLP, 2 processes (measured in the workers)", 300),
    "loader": ("benchmarks.m_train:run_loader", "3. Prepared DataLoader batches/s, trivial data set", 150),
    "memory": ("benchmarks.m_memory:run", "4. Memory: a tensor data set in the parent, 2 workers read their halves", 240),
    "failure": ("benchmarks.m_failure:run", "5. Failure teardown", 240),
    "output": ("benchmarks.m_output:run", "6. Output: many lines per rank", 180),
    "warm": ("benchmarks.m_warm:run", "7. Warm ranks: a call on ranks kept up, against starting them per call", 240),
    "ray": ("benchmarks.m_ray:run", "8. Several machines on Ray: 2 nodes simulated here, 2 ranks each", 600),
    "fsdp": ("benchmarks.m_fsdp:run", "9. A model sharded over 2 ranks (FSDP2, ZeRO-3) against DDP", 600),
    # Measures nothing (and says why) without a CUDA device; tools/gpu_lane.sh runs it on one.
    "gpu": ("benchmarks.m_gpu:run", "10. One CUDA GPU: a small transformer's steps/s, a launch after CUDA was "
            "initialised, a failure", 420),
    "slurm": ("benchmarks.m_slurm:run", "11. Several machines on Slurm: a real Slurm of 2 nodes here, 2 ranks each",
              900),
    "rerun": ("benchmarks.m_rerun:run", "12. Re-running a cell: a later launch of a function that imports "
              "scikit-learn and trains a small CNN, 2 s after the one before", 600),
    "sweep": ("benchmarks.m_sweep:run", "13. A sweep: 5 launches back to back of that function, in a script and "
              "in one cell", 600),
    "compile": ("benchmarks.m_compile:run", "14. Compiled re-runs: a model compiled with Inductor, 2 ranks, launched "
                "again in the same interpreter and after a restart", 900),
    "split": ("benchmarks.m_split:run", "15. The step split's cost: DDP steps/s inside a launch with the split on "
              "and off, beside raw torch and Accelerate", 420),
    "stop": ("benchmarks.m_stop:run", "16. Stop and pick up again: a DDP run interrupted after step 30, what it "
             "keeps and what the stop, the save and the resume cost", 420),
}


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), platform.processor())
    except OSError:
        info["cpu"] = platform.processor()
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        info["usable_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    for name in ("torch", "accelerate", "nblaunch"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    return info


def run_child(name: str, quick: bool, size: str | None, limit: float) -> dict:
    """Run one measurement in a fresh interpreter, in a process group of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        log_path = os.path.join(tmp, "log.txt")
        cmd = [sys.executable, "-m", "benchmarks.run", "--child", name, "--result", result_path]
        if quick:
            cmd.append("--quick")
        if size:
            cmd += ["--size", size]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        # A temporary folder of its own, as on a fresh machine: nblaunch's log folders and launch
        # records of earlier runs (a thousand after a full run) are not this run's to list or prune.
        env["TMPDIR"] = os.path.join(tmp, "t")
        os.mkdir(env["TMPDIR"])
        started = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            try:
                proc.wait(timeout=limit)
                status = "ok" if proc.returncode == 0 else f"failed (exit code {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit:g} s"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the measurement and anything it left behind
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        elapsed = time.monotonic() - started
        result = {"rows": [], "notes": []}
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
        elif status == "ok":
            status = "failed (no result written)"
        if status != "ok":
            with open(log_path, errors="replace") as f:
                result["log_tail"] = f.read()[-3000:]
        result.update(status=status, seconds=round(elapsed, 1))
        return result


def compile_like_pip() -> None:
    """Byte-compile nblaunch as pip does when it installs a package. Run from a checkout where
    nothing writes bytecode (``PYTHONDONTWRITEBYTECODE``, as in many containers and CI images),
    every fresh interpreter would compile each of its modules again: 0.1 s of the import rows
    that no installed copy pays, while torch and Accelerate come byte-compiled."""
    import compileall

    compileall.compile_dir(os.path.join(ROOT, "nblaunch"), quiet=1)


def child_main(name: str, result_path: str, quick: bool, size: str | None) -> int:
    import importlib

    target, _, _ = MEASUREMENTS[name]
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(quick=quick, size=size)
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(result_path + ".tmp", result_path)
    return 0


# ----------------------------------------------------------------------------- report
def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms" or unit == "ms/step":
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    if unit == "s":
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    if unit == "x":
        return f"{value:.3f}"
    if unit in ("steps/s", "batches/s"):
        return f"{value:.1f}" if value < 1000 else f"{value:.0f}"
    if isinstance(value, float) and value != int(value):
        return f"{value:.2f}"
    return f"{value:g}"


def _ratio_text(ratios: dict | None) -> str:
    if not ratios:
        return ""
    parts = []
    for label, s in ratios.items():
        if s.get("median") is None:
            continue
        if "minus" in label:
            parts.append(f"{s['median']:+.3f} ms {label.replace('minus ', 'vs ').replace(' (ms)', '')}")
        else:
            parts.append(f"{s['median']:.2f}x {label} ({s['min']:.2f}-{s['max']:.2f})")
    return "; ".join(parts)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# nblaunch benchmarks",
        "",
        f"Measured {report['date']} on {m.get('cpu')} ({m.get('usable_cores', m.get('cores'))} cores, "
        f"{m.get('memory_gib', '?')} GiB), {m.get('platform')}; Python {m.get('python')}, torch {m.get('torch')}, "
        f"accelerate {m.get('accelerate')}, nblaunch {m.get('nblaunch')}. Command: `{report['command']}`"
        f"{' (quick run: fewer rounds, smaller sizes)' if report.get('quick') else ''}.",
        "",
        "Implementations are interleaved (A B C, B C A, ...); median, min and max over the rounds; ratios are "
        "the median (min-max) of per-round ratios. \"met\" checks nblaunch against the goal of the issue. "
        "nblaunch is byte-compiled first, as pip does at install; each measurement gets a temporary folder "
        "of its own.",
    ]
    for name, res in report["results"].items():
        lines += ["", f"## {res.get('title', name)}", ""]
        if res.get("status") != "ok":
            lines += [f"**{res.get('status')}**", ""]
        if res.get("rows"):
            lines += ["| implementation | metric | median | min | max | n | ratio | goal | met |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in res["rows"]:
                unit = r.get("unit", "")
                met = "" if r.get("met") is None else ("yes" if r["met"] else "**no**")
                extra = _ratio_text(r.get("ratios"))
                if r.get("note"):
                    extra = (extra + "; " if extra else "") + r["note"]
                lines.append(
                    f"| {r['impl']} | {r['metric']}{f' ({unit})' if unit else ''} | {_fmt(r.get('median'), unit)} | "
                    f"{_fmt(r.get('min'), unit)} | {_fmt(r.get('max'), unit)} | {r.get('n', 0)} | {extra} | "
                    f"{r.get('goal', '')} | {met} |")
        for note in res.get("notes", []):
            lines.append(f"\n- {note}")
        lines.append(f"\n_{res.get('seconds', '?')} s for this measurement._")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"measurements to run (default: all): {', '.join(MEASUREMENTS)}")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and smaller sizes (about 3 minutes)")
    parser.add_argument("--size", choices=["tiny"], help=argparse.SUPPRESS)  # the smoke test's sizes
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for latest.json / latest.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        return child_main(opts.child, opts.result, opts.quick, opts.size)
    names = opts.names or list(MEASUREMENTS)
    unknown = [n for n in names if n not in MEASUREMENTS]
    if unknown:
        parser.error(f"unknown measurement(s) {', '.join(unknown)}; choose from {', '.join(MEASUREMENTS)}")
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m benchmarks" + (" --quick" if opts.quick else "") + (" " + " ".join(opts.names) if opts.names else ""),
        "quick": opts.quick,
        "machine": machine(),
        "results": {},
    }
    compile_like_pip()
    for name in names:
        target, title, limit = MEASUREMENTS[name]
        print(f"[benchmarks] {name}: running (limit {limit} s) ...", file=sys.stderr, flush=True)
        result = run_child(name, opts.quick, opts.size, limit)
        result["title"] = title
        report["results"][name] = result
        print(f"[benchmarks] {name}: {result['status']} in {result['seconds']} s", file=sys.stderr, flush=True)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "latest.json"), "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(os.path.join(opts.out, "latest.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r["status"] == "ok" for r in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
