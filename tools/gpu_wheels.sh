#!/usr/bin/env bash
# Fetch, into .whl/ at the repository root, exactly the wheels tools/gpu_lane.sh installs on the GPU
# machine: the Jupyter stack that nblaunch and tests/gpu need (a real kernel run by nbclient, the
# widget display) and that machine lacks. It has Python 3.12 on x86-64 with torch, accelerate,
# transformers, pytest, psutil, cloudpickle, numpy, packaging, attrs, pygments, python-dateutil, six
# and typing-extensions already, and no package registry: these travel with the repository instead.
#
# Pinned to the versions the CPU suite runs with (ipykernel 7, IPython 9, ipywidgets 8), as wheels
# for CPython 3.12 on manylinux x86-64. Idempotent: a wheel already in .whl/ is not fetched again, and
# any other file there (another version) is removed, since two versions of one package stop the install.
#
# .whl/ is local: this script adds /.whl/ (and /gpu-lane-out/, the lane's default output) to
# .git/info/exclude, and a device run names .whl in its `carry` list.
#
# Usage: bash tools/gpu_wheels.sh        (PYTHON=... to use another interpreter's pip; any version)
set -euo pipefail
cd "$(dirname "$0")/.."

# name==version, names as wheel files spell them (lower case, underscores).
PINS=(
    ipykernel==7.4.0 ipython==9.18.1 ipywidgets==8.1.9 nbclient==0.11.0 nbformat==5.11.1
    jupyter_client==8.10.0 jupyter_core==5.9.1 traitlets==5.16.1 comm==0.2.3 pyzmq==27.3.0 tornado==6.6.1
    debugpy==1.8.22 matplotlib_inline==0.2.2 nest_asyncio2==1.7.4 platformdirs==4.14.8
    prompt_toolkit==3.0.53 wcwidth==0.9.4 jedi==0.20.1 parso==0.8.7 pexpect==4.9.0 ptyprocess==0.7.0
    stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 ipython_pygments_lexers==1.1.1
    fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 referencing==0.37.0
    rpds_py==2026.9.1 widgetsnbextension==4.0.16 jupyterlab_widgets==3.0.17
    # The stacks for models bigger than a device (tests/gpu/test_gpu_7_stretch.py): torchao for fp8,
    # DeepSpeed (built here from its source package: it publishes no wheel; pure Python, its ops
    # compile on the GPU machine on first use) and what DeepSpeed needs beyond torch.
    torchao==0.18.0 deepspeed==0.19.8 hjson==3.1.0 py_cpuinfo==9.0.0 ninja==1.13.2 einops==0.8.2
    msgpack==1.2.4 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
)
BUILT_HERE=(deepspeed)  # source packages only: built into a wheel with this interpreter's pip
PYTHON=${PYTHON:-python3}
mkdir -p .whl

exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
mkdir -p "$(dirname "$exclude")"
for pattern in /.whl/ /gpu-lane-out/; do
    grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >>"$exclude"
done

wanted=()
for pin in "${PINS[@]}"; do
    name=${pin%%==*}; version=${pin#*==}
    wanted+=("$name-$version-")
    if compgen -G ".whl/$name-$version-*.whl" >/dev/null; then
        continue
    fi
    if [[ " ${BUILT_HERE[*]} " == *" $name "* ]]; then
        "$PYTHON" -m pip wheel -q --no-deps -w .whl "$name==$version"
        continue
    fi
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "$name==$version"
done

for file in .whl/*; do
    base=$(basename "$file")
    keep=no
    for prefix in "${wanted[@]}"; do
        [[ "$base" == "$prefix"*.whl ]] && keep=yes && break
    done
    if [ "$keep" = no ]; then
        echo "gpu_wheels: removing $base (not pinned here)"
        rm -rf -- "$file"
    fi
done

count=$(find .whl -type f -name '*.whl' | wc -l)
bytes=$(find .whl -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
echo "gpu_wheels: $count wheels in .whl/, $((bytes / 1024 / 1024)) MiB ($bytes bytes;" \
    "a device run carries at most 64 MiB in all)"
if [ "$count" -ne "${#PINS[@]}" ]; then
    echo "gpu_wheels: expected ${#PINS[@]} wheels, found $count" >&2
    exit 1
fi
