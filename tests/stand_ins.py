"""Stand-ins for what this machine lacks (an NVIDIA driver), built for real, and a fresh
interpreter to load them in: the one place tests replace something, and only below nblaunch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


def run_child(script: str, tmp_path, env: dict | None = None, timeout: float = 180) -> tuple[dict, str]:
    """Run ``script`` in a fresh interpreter; its ``RESULT {json}`` line and everything it printed."""
    path = tmp_path / "child.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [line] = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), proc.stdout


FAKE_NVML = r'''
#include <stdio.h>
#include <stdlib.h>
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned int *count) {
    const char *gpus = getenv("FAKE_NVML_GPUS");
    *count = gpus ? (unsigned int) atoi(gpus) : 0;
    return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) { *device = (void *) 1; return 0; }
int nvmlDeviceGetCudaComputeCapability(void *device, int *major, int *minor) {
    const char *cc = getenv("FAKE_NVML_CC");  /* "7.5": a T4 */
    *major = cc ? atoi(cc) : 8;
    *minor = cc ? atoi(cc + 2) : 0;
    return 0;
}
/* What a rank's row shows: 3 of 16 GiB used, 87% busy; the processes, one pid a line, from
   the file FAKE_NVML_PIDS_FILE names (each using 1 GiB). */
typedef struct { unsigned long long total, free, used; } memory_t;
int nvmlDeviceGetMemoryInfo(void *device, memory_t *m) {
    m->total = 16ULL << 30; m->used = 3ULL << 30; m->free = m->total - m->used;
    return 0;
}
typedef struct { unsigned int gpu, memory; } utilization_t;
int nvmlDeviceGetUtilizationRates(void *device, utilization_t *u) { u->gpu = 87; u->memory = 40; return 0; }
typedef struct { unsigned int pid; unsigned long long used; unsigned int gpu_instance, compute_instance; } process_t;
int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, process_t *processes) {
    const char *path = getenv("FAKE_NVML_PIDS_FILE");
    unsigned int pids[64], n = 0;
    FILE *f = path ? fopen(path, "r") : NULL;
    if (f) { while (n < 64 && fscanf(f, "%u", &pids[n]) == 1) n++; fclose(f); }
    if (n == 0) { *count = 0; return 0; }
    if (processes == NULL || *count < n) { *count = n; return 7; }  /* NVML_ERROR_INSUFFICIENT_SIZE */
    for (unsigned int i = 0; i < n; i++) {
        processes[i].pid = pids[i]; processes[i].used = 1ULL << 30;
        processes[i].gpu_instance = processes[i].compute_instance = 0;
    }
    *count = n;
    return 0;
}
'''

def stand_in_library(tmp_path, name: str, source: str) -> dict[str, str]:
    """Build a stand-in for a driver library (``source``, C) with the C compiler; the environment
    of a child interpreter that loads it instead of the real one."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip(f"no C compiler to build the stand-in {name}")
    lib = tmp_path / "driver"
    lib.mkdir(exist_ok=True)
    (lib / f"{name}.c").write_text(source)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib / name), str(lib / f"{name}.c")], check=True)
    return {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(lib), os.environ.get("LD_LIBRARY_PATH")]))}


