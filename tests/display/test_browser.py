"""The dashboard in a real browser: JupyterLab 4 and Notebook 7 in headless Chromium, driven by Playwright.

Runs notebooks/widget_demo.ipynb and checks the rendered page: both ranks' rows reach "done",
a progress bar is seen part-way, the loss chart has its points, the static summary is there.
Screenshots go to artifacts/. Needs what .ci/browser-setup.sh installs; without Chromium the
test skips, except under CI (CI set), where a missing browser is a failure.
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

ROOT = Path(__file__).parents[2]
NOTEBOOK = ROOT / "notebooks" / "widget_demo.ipynb"
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync",
]

pytestmark = [pytest.mark.browser, pytest.mark.slow]


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
    """A JupyterLab server on localhost with a token and a temporary root holding the notebook."""
    _require(Path(CHROMIUM).exists(), "Chromium (/usr/bin/chromium)")
    _require(shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is not None, "jupyterlab")
    pytest.importorskip("tqdm")
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
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


# Conditions evaluated in the page; the dashboard's elements carry nbl-* classes and data-*.
BAR_PART_WAY = """() => [...document.querySelectorAll('.nblaunch-dashboard .nbl-bar')].some(b => {
    const n = Number(b.dataset.n), total = Number(b.dataset.total);
    const width = parseFloat(b.querySelector('.nbl-fill').style.width);
    return total > 0 && n > 0 && n < total && width > 0 && width < 100;
})"""
CHART_POINTS = """() => [...document.querySelectorAll(
    '.nbl-summary svg.nbl-chart[data-metric="loss"] polyline.nbl-line')].map(p => [
    p.dataset.series, p.getAttribute('points').trim().split(/\\s+/).length])"""
# One view once the launch is over: the summary took the dashboard's place.
DASHBOARD_GONE = "() => document.querySelector('.nblaunch-dashboard') === null"
NEWEST_LOG_LINE_VISIBLE = """() => {
    const box = document.querySelector('.nblaunch-dashboard .nbl-log[data-rank="all"] > div');
    const pre = box.querySelector('pre');
    return box.scrollHeight > box.clientHeight
        && Math.abs(pre.getBoundingClientRect().bottom - box.getBoundingClientRect().bottom) < 3;
}"""
SUMMARY_DONE = "() => document.querySelector('.nbl-summary[data-state=\"done\"]') !== null"
KERNEL_IDLE = (
    "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
    " && window.jupyterapp.shell.currentWidget.sessionContext"
    " && window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel?.status === 'idle'"
)


def test_the_dashboard_renders_and_follows_the_launch_in_jupyterlab(lab, browser):
    base, token, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    # Not awaited: the command's promise settles only once every cell has run.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

    page.wait_for_function(BAR_PART_WAY, timeout=120_000)
    page.screenshot(path=str(ARTIFACTS / "widget_demo_running.png"), full_page=True)
    page.wait_for_function(NEWEST_LOG_LINE_VISIBLE, timeout=120_000)  # the log box follows its newest lines
    page.wait_for_function(SUMMARY_DONE, timeout=120_000)
    page.wait_for_function(DASHBOARD_GONE, timeout=10_000)

    points = dict(page.evaluate(CHART_POINTS))
    assert points == {"rank 0": 40, "rank 1": 40}
    summary = page.locator(".nbl-summary")
    assert summary.count() == 1
    assert "train" in summary.inner_text() and "done" in summary.inner_text()
    assert "rank 1 step 39" in summary.text_content()  # in a folded log tail
    summary.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "widget_demo_summary.png"), full_page=True)
    assert not errors, errors
    page.close()


def test_the_dashboard_renders_and_follows_the_launch_in_notebook_7(lab, browser):
    pytest.importorskip("notebook", minversion="7")
    base, token, _ = lab
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{base}/notebooks/{NOTEBOOK.name}?token={token}")
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    before = len(errors)  # Notebook 7's own page raises one settings error on load; not ours
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    page.wait_for_function(SUMMARY_DONE, timeout=120_000)
    page.wait_for_function(DASHBOARD_GONE, timeout=10_000)
    assert dict(page.evaluate(CHART_POINTS)) == {"rank 0": 40, "rank 1": 40}
    assert "done" in page.locator(".nbl-summary").inner_text()
    page.screenshot(path=str(ARTIFACTS / "widget_demo_notebook7.png"), full_page=True)
    assert errors[before:] == [], errors[before:]
    page.close()
