"""The real-browser tests' fixtures: a JupyterLab server and headless Chromium (Playwright).

Needs what .ci/browser-setup.sh installs; without Chromium the tests skip, except under CI (CI
set), where a missing browser is a failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync",
]


def _require(ok: bool, what: str) -> None:
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing; in CI the browser test must run (see .ci/browser-setup.sh)")
    pytest.skip(f"{what} is missing (install with .ci/browser-setup.sh); set CI=1 to make this a failure")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition``; the timeout is a backstop, not a synchronisation."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on localhost with a token and a temporary root; tests copy their notebooks in."""
    _require(Path(CHROMIUM).exists(), "Chromium (/usr/bin/chromium)")
    _require(shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is not None, "jupyterlab")
    pytest.importorskip("tqdm")
    root = tmp_path_factory.mktemp("lab")
    port, token = _free_port(), secrets.token_hex(16)
    config = root / ".config"
    # No "get Jupyter news?" toast over the page (and no fetching from the internet).
    notification = config / "lab/user-settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(root / ".runtime"), JUPYTER_CONFIG_DIR=str(config))
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--JupyterNotebookApp.expose_app_in_browser=True",  # Notebook 7, served by the same server
            *(["--allow-root"] if os.geteuid() == 0 else []),  # CI containers often run as root
        ],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert server.poll() is None, (root / "server.log").read_text()
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    try:
        _wait_until(up, 120, "the Jupyter server to answer")
        yield base, token, root
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()
