#!/usr/bin/env bash
# System packages for tests/display/test_browser.py on a fresh Debian machine (run as root):
# Debian's Chromium, driven by Playwright with executable_path (no browser download).
# The Python side (jupyterlab, playwright) comes from the project's "test" extra.
# Safe to run again: an installed Chromium is kept.
set -euo pipefail

if ! command -v chromium >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi
chromium --version
