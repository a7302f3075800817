#!/usr/bin/env bash
# A C++ compiler for DeepSpeed on CPU ranks (tests/training/test_deepspeed.py, the bigger-models
# notebook): DeepSpeed compiles its CPU communication op with g++ the first time a process group
# starts. Safe to run again: an installed compiler is kept.
set -euo pipefail

if command -v g++ >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends g++ >/dev/null
