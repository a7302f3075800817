#!/usr/bin/env bash
# The GPU lane of issue 31 in one command, on a machine with one CUDA GPU and no package registry:
# a fresh venv that reuses the machine's torch, accelerate and transformers, the Jupyter stack from
# the wheels tools/gpu_wheels.sh put in .whl/, nblaunch itself (editable), then tests/gpu (marked
# `gpu`), then `python -m benchmarks gpu` (steps/s, a launch after CUDA init, the failure path), and
# a report: 8 minutes at most, 4.5 with --quick (one round of each measurement).
#
#   bash tools/gpu_lane.sh [--quick]   from the repository root (a device run: carry .whl; see below)
#
# Writes under $OUT (./gpu-lane-out when OUT is unset), flat, 7 files: report.md (machine, versions,
# date, each numbered item of the issue with pass/fail and numbers), benchmark.md and benchmark.json
# (python -m benchmarks gpu), junit.xml, versions.json, status.json, lane.log (everything printed).
# Copy report.md, benchmark.md and benchmark.json to benchmarks/results/gpu/ to commit them.
#
# Without a CUDA device it runs all the same: the GPU tests skip with one-line reasons, the benchmark
# measures nothing, and the report says "no CUDA device".
#
# The device run (one call, the command line as it is):
#   command: bash tools/gpu_lane.sh      carry: [".whl"]      timeout_s: 600
#
# Environment: GPU_LANE_PYTHON (the interpreter whose packages are reused; default: python3 where
# /opt/torch exists, else ./.venv/bin/python, else python3), GPU_LANE_VENV (default
# $TMPDIR/nblaunch-gpu-lane-venv, made afresh), GPU_LANE_BUDGET_S (default 480, or 270 with --quick:
# the whole lane), GPU_LANE_TESTS (what pytest runs; default tests/gpu) and NBLAUNCH_GPU_BENCH_PARTS
# (the benchmark's parts, comma-separated: tutorial, train, failure, launch; default all): to run
# again only what failed, on a machine lent for minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
lane_quick=0
[ "${1:-}" = "--quick" ] && lane_quick=1
budget=${GPU_LANE_BUDGET_S:-$([ "$lane_quick" = 1 ] && echo 270 || echo 480)}
OUT=${OUT:-$PWD/gpu-lane-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/lane.log") 2>&1
tee_pid=$!
export PYTHONUNBUFFERED=1
say() { echo "gpu_lane [$((SECONDS - started)) s]: $*"; }

if [ -n "${GPU_LANE_PYTHON:-}" ]; then
    base=$GPU_LANE_PYTHON
elif [ -d /opt/torch ] || [ ! -x .venv/bin/python ]; then
    base=python3
else
    base=.venv/bin/python
fi
base=$(command -v "$base") || { echo "gpu_lane: no interpreter $base" >&2; exit 2; }
venv=${GPU_LANE_VENV:-${TMPDIR:-/tmp}/nblaunch-gpu-lane-venv}
py=$venv/bin/python
say "base interpreter $base ($("$base" -c 'import sys; print(sys.version.split()[0])')), venv $venv"

# A venv made from a venv's interpreter sees the *base* installation's packages, not that venv's
# (the GPU machine's python3 is /opt/torch/.venv): a .pth adds the interpreter's own site-packages
# after the new venv's, so torch & co are reused and what is installed here comes first. pip comes
# from the reused site-packages too, and installs into this venv (sys.prefix).
rm -rf "$venv"
target=()
if "$base" -m venv --without-pip --system-site-packages "$venv"; then
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$base" -c 'import site; [print(f"import site; site.addsitedir({p!r})") for p in site.getsitepackages()]' \
        >"$site/_gpu_lane_reuse.pth"
    # The kernels nbclient starts: this venv's ipykernel spec first, whatever else the machine has.
    export JUPYTER_PATH="$venv/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
else  # no venv module here: the packages go to a folder on PYTHONPATH instead
    py=$base
    site=$venv/site
    mkdir -p "$site"
    target=(--target "$site")
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export JUPYTER_PATH="$site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
    say "no venv: packages in $site, nblaunch from $PWD, both on PYTHONPATH"
fi

if ! "$py" -c 'import nbclient, nbformat, ipykernel, ipywidgets, jupyter_client' 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        say "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ (no index)"
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${target[@]}" .whl/*.whl \
            || echo "gpu_lane: installing the wheels failed" >&2
    else
        echo "gpu_lane: the Jupyter stack is missing and .whl/ is empty: run tools/gpu_wheels.sh and carry .whl" >&2
    fi
fi
if [ ${#target[@]} -eq 0 ] && ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    say "editable install failed; nblaunch comes from the source tree through a .pth"
    echo "$PWD" >"$site/_nblaunch_source.pth"
fi
"$py" -m pip check || say "(pip check reports the above; the lane goes on)"

"$py" tools/gpu_report.py versions "$OUT"
cat "$OUT/versions.json"
nvidia-smi 2>/dev/null || say "nvidia-smi: not here"

# The tests get what is left but the benchmark's share; the benchmark the rest, one round when short.
# (On an H100 the tests took 88 s before issue 44 added its own; the benchmark: the tutorial about 110 s,
# its three other parts about 60 s a round.)
left=$((budget - (SECONDS - started)))
bench_share=$([ "$lane_quick" = 1 ] && echo 150 || echo 230)
tests_limit=$((left - bench_share < 300 ? left - bench_share : 300))
[ "$tests_limit" -lt 60 ] && tests_limit=60
per_test=()  # one hung test must not take the others' time (pytest-timeout, where installed)
"$py" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 240)
lane_tests=${GPU_LANE_TESTS:-tests/gpu}
say "pytest $lane_tests -m gpu (limit ${tests_limit} s)"
timeout -k 10 "$tests_limit" "$py" -m pytest $lane_tests -m gpu -p no:cacheprovider -rA "${per_test[@]}" \
    --junitxml="$OUT/junit.xml" -o junit_family=xunit1
pytest_exit=$?
[ "$pytest_exit" -eq 124 ] && say "pytest stopped at its limit of ${tests_limit} s"

left=$((budget - (SECONDS - started) - 20))
bench="not run"
if [ "$left" -ge 60 ]; then
    quick=()
    { [ "$lane_quick" = 1 ] || [ "$left" -lt 150 ]; } && quick=(--quick)
    say "python -m benchmarks gpu ${quick[*]} (limit ${left} s; samples past it are not taken)"
    bench_dir=$(mktemp -d)
    NBLAUNCH_BENCH_DEADLINE=$(($(date +%s) + left - 15)) \
        timeout -k 10 "$left" "$py" -m benchmarks gpu "${quick[@]}" --out "$bench_dir"
    bench="exit code $?"
    cp "$bench_dir/latest.md" "$OUT/benchmark.md" 2>/dev/null
    cp "$bench_dir/latest.json" "$OUT/benchmark.json" 2>/dev/null
    rm -rf "$bench_dir"
else
    bench="not run: only ${left} s left of the lane's ${budget} s"
fi

printf '{"seconds": %d, "pytest_exit": %d, "benchmark": "%s"}\n' "$((SECONDS - started))" "$pytest_exit" "$bench" \
    >"$OUT/status.json"
"$py" tools/gpu_report.py report "$OUT" || { echo "gpu_lane: the report could not be written" >&2; exit 1; }
say "done: $OUT/report.md"
cat "$OUT/report.md"
rm -rf "$venv"
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null  # lane.log complete before $OUT is read
exit "$pytest_exit"
