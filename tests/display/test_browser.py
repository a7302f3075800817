"""The dashboard in a real browser: JupyterLab 4 and Notebook 7 in headless Chromium, driven by Playwright.

Runs notebooks/widget_demo.ipynb and checks the rendered page: both ranks' rows reach "done",
a progress bar is seen part-way, the loss chart has its points, the static summary is there.
Screenshots go to artifacts/. The server and browser fixtures are in conftest.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pagejs import KERNEL_IDLE

ROOT = Path(__file__).parents[2]
NOTEBOOK = ROOT / "notebooks" / "widget_demo.ipynb"
ARTIFACTS = ROOT / "artifacts"

pytestmark = pytest.mark.browser

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


def test_the_dashboard_renders_and_follows_the_launch_in_jupyterlab(lab, browser):
    base, token, root = lab
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
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
    # The dashboard alone, mid-launch: README's picture (docs/refresh.py copies it to docs/images).
    page.locator(".nblaunch-dashboard").first.screenshot(path=str(ARTIFACTS / "widget_demo_dashboard.png"))
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
    base, token, root = lab
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
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
