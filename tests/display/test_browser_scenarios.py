"""The launch cell in a real browser, scenario by scenario: JupyterLab 4 in headless Chromium.

Runs tests/display/scenarios.ipynb one cell at a time (a failing cell does not keep the next
ones from running) and takes screenshots into artifacts/:

* ``running``: a long launch part-way (a 65-character progress description, 220-character
  lines, a loss over many decades);
* ``finished``: the same cell once the launch is over;
* ``split_running`` and ``split_finished``: rank 1 waits for its data each step: each rank's step
  split in its row, the header naming rank 1, the summary;
* ``failed``: rank 1 raises ValueError from a helper, rank 0 is stopped;
* ``interrupted``: the kernel is interrupted while both ranks run;
* ``nonblocking_running`` and ``nonblocking_finished``: ``block=False``, then ``launch.result()``.

Each scenario gives ``scenario_<name>.png`` (the JupyterLab window, the cell scrolled to the
top), ``scenario_<name>_cell.png`` (the cell(s) alone, cropped; the window is made taller when
they do not fit) and ``scenario_<name>.json`` (sizes, overflowing elements, counts, texts).
Every screenshot is taken before anything is asserted: the module fixture drives the notebook
and records what it saw, the tests then judge the record. So the screenshots come out even
where the assertions fail (an older version of nblaunch, for comparison).

The fixtures (the Jupyter server, Chromium) are in conftest.py.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from pagejs import KERNEL_IDLE

ROOT = Path(__file__).parents[2]
NOTEBOOK = Path(__file__).with_name("scenarios.ipynb")
ARTIFACTS = ROOT / "artifacts"
VIEWPORT = {"width": 1280, "height": 1100}
MAX_HEIGHT = 8000  # the tallest window a cropped screenshot may ask for
NEEDLES = ["bad batch shape", "nblaunch/", "Traceback", "rank 1 step 39"]  # counted in each record

pytestmark = pytest.mark.browser

# Backstops, not synchronisation: every wait is on a condition in the page.
CELL_S = 180  # one cell's run, a launch included (two cores, a test suite beside it)
SOFT_S = 20  # an end state the current code reaches at once; older code may never reach it

# -- in the page ------------------------------------------------------------------------------

# Marks every cell's node with its id (the notebook's cell ids), so locators can find it.
MARK_CELLS = """(expected) => {
    const panel = window.jupyterapp.shell.currentWidget;
    const cells = panel.content.widgets;
    if (cells.length !== expected) return false;
    for (const cell of cells) cell.node.setAttribute('data-nbl-cell', cell.model.id);
    return cells.map(cell => cell.model.id);
}"""
# Runs one cell; the command's promise settles once the cell has run (failed or not).
RUN_CELL = """(id) => {
    const app = window.jupyterapp;
    const notebook = app.shell.currentWidget.content;
    const index = notebook.widgets.findIndex(cell => cell.model.id === id);
    if (index < 0) throw new Error('no cell ' + id);
    notebook.activeCellIndex = index;
    notebook.deselectAll();
    window.nblRuns = window.nblRuns || {};
    window.nblRuns[id] = 'running';
    app.commands.execute('notebook:run-cell').then(
        () => { window.nblRuns[id] = 'done'; },
        error => { window.nblRuns[id] = 'error: ' + error; });
    return index;
}"""
CELL_RAN = "(id) => window.nblRuns && window.nblRuns[id] && window.nblRuns[id] !== 'running'"
INTERRUPT = "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.interrupt()"


def _in_cell(selector: str) -> str:
    return f"document.querySelectorAll(`[data-nbl-cell=\"${{id}}\"] {selector}`)"


BAR_PART_WAY = f"""(id) => [...{_in_cell('.nblaunch-dashboard .nbl-bar')}].some(b => {{
    const n = Number(b.dataset.n), total = Number(b.dataset.total);
    const width = parseFloat(b.querySelector('.nbl-fill').style.width);
    return total > 0 && n > 0 && n < total && width > 0 && width < 100;
}})"""
BOTH_RANKS_RUNNING = f"(id) => {_in_cell('.nblaunch-dashboard tr.nbl-rank[data-state=running]')}.length === 2"
HAS_SUMMARY = f"(id) => {_in_cell('.nbl-summary')}.length > 0"
SPLIT_SHOWN = (f"(id) => {_in_cell('.nblaunch-dashboard .nbl-split')}.length === 2 && "
               f"[...{_in_cell('.nblaunch-dashboard .nbl-finding')}].some(e => e.innerText.includes('rank 1 holds'))")
_STRAGGLER_1 = '.nbl-summary .nbl-steps[data-straggler="1"]'
SPLIT_SUMMARY = f"(id) => {_in_cell(_STRAGGLER_1)}.length === 1"
ONE_VIEW = f"(id) => {_in_cell('.nbl-summary')}.length > 0 && {_in_cell('.nblaunch-dashboard')}.length === 0"
STACKS_SHOWN = f"(id) => {_in_cell('.nblaunch-dashboard .nbl-stacks details')}.length === 2"
STALE_SHOWN = f"""(id) => [...{_in_cell('.nbl-stale')}].some(e => parseFloat(getComputedStyle(e).fontSize) > 0)"""
CLICK_STACKS = f"""(id) => [...{_in_cell('.nblaunch-dashboard button')}].find(b => b.innerText.includes('Stacks')).click()"""
RESTART = "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart()"
CELL_TEXT = "(id) => document.querySelector(`[data-nbl-cell=\"${id}\"] .jp-Cell-outputArea`).textContent"

# Scrolls the first cell to the top of the notebook; returns whether the last one fits below it.
SCROLL_TO = """(ids) => {
    const cells = ids.map(id => document.querySelector(`[data-nbl-cell="${id}"]`));
    cells[0].scrollIntoView({block: 'start'});
    let scroller = cells[0].parentElement;
    while (scroller && !['auto', 'scroll'].includes(getComputedStyle(scroller).overflowY)) {
        scroller = scroller.parentElement;
    }
    const top = cells[0].getBoundingClientRect().top;
    const bottom = Math.max(...cells.map(c => c.getBoundingClientRect().bottom));
    const visible = scroller ? scroller.getBoundingClientRect() : {top: 0, bottom: window.innerHeight};
    return {needed: Math.ceil(bottom - Math.max(top, visible.top)), room: Math.floor(visible.bottom - Math.max(top, visible.top)),
            fits: bottom <= visible.bottom + 0.5, windowHeight: window.innerHeight};
}"""
CLIP = """(ids) => {
    const boxes = ids.map(id => document.querySelector(`[data-nbl-cell="${id}"]`).getBoundingClientRect());
    const x = Math.min(...boxes.map(b => b.left)), y = Math.min(...boxes.map(b => b.top));
    const right = Math.max(...boxes.map(b => b.right)), bottom = Math.max(...boxes.map(b => b.bottom));
    return {x: Math.max(0, x), y: Math.max(0, y), width: right - x, height: bottom - y};
}"""
# What a cell's output looks like, in numbers: for the record and for the assertions.
OBSERVE = """(id) => {
    const cell = document.querySelector(`[data-nbl-cell="${id}"]`);
    const area = cell.querySelector('.jp-Cell-outputArea');
    const box = e => { const r = e.getBoundingClientRect(); return {width: Math.round(r.width), height: Math.round(r.height)}; };
    const name = e => e.tagName.toLowerCase() + [...e.classList].filter(c => !c.startsWith('lm-')).map(c => '.' + c).join('');
    const areaBox = area.getBoundingClientRect();
    const overflowing = [...area.querySelectorAll('*')]
        .filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
        .slice(0, 20)
        .map(e => ({element: name(e), clientWidth: e.clientWidth, scrollWidth: e.scrollWidth,
                    overflowX: getComputedStyle(e).overflowX, textOverflow: getComputedStyle(e).textOverflow}));
    const spillRight = Math.max(0, ...[...area.querySelectorAll('*')].map(e => e.getBoundingClientRect().right - areaBox.right));
    const outputs = [...area.querySelectorAll(':scope .jp-OutputArea-child')].map(child => {
        const output = child.querySelector('.jp-OutputArea-output');
        const mime = output && output.getAttribute('data-mime-type');
        return {mime: mime || (child.querySelector('.jupyter-widgets') ? 'widget' : null), ...box(child),
                textLength: child.textContent.length,
                text: child.innerText.length > 600 ? child.innerText.slice(0, 300) + ' … ' + child.innerText.slice(-300) : child.innerText};
    });
    const rows = [...area.querySelectorAll('tr.nbl-rank')].map(r => ({
        view: r.closest('.nbl-summary') ? 'summary' : (r.closest('.nblaunch-dashboard') ? 'dashboard' : 'other'),
        rank: r.dataset.rank, state: r.dataset.state}));
    const bars = [...area.querySelectorAll('.nbl-bar')].map(b => ({
        n: Number(b.dataset.n), total: Number(b.dataset.total), fill: b.querySelector('.nbl-fill')?.style.width,
        text: b.innerText}));
    return {
        output: box(area), scrollWidth: area.scrollWidth, spillRight: Math.round(spillRight),
        outputs, overflowing,
        dashboards: area.querySelectorAll('.nblaunch-dashboard').length,
        summaries: [...area.querySelectorAll('.nbl-summary')].map(s => ({state: s.dataset.state, ...box(s),
                                                                            headline: s.innerText.split('\\n')[0]})),
        ranks: rows, bars,
        text: area.textContent, visibleText: area.innerText,
        executionCount: cell.querySelector('.jp-InputPrompt')?.textContent ?? null,
        // Layout: what a user would see cut, spilled or overlapping.
        ranksFit: [...area.querySelectorAll('.nbl-ranks-box')].map(b => b.scrollWidth <= b.clientWidth + 1),
        barsInCells: [...area.querySelectorAll('.nbl-bar')].map(
            b => b.getBoundingClientRect().right <= b.closest('td').getBoundingClientRect().right + 1),
        chartLabelsInside: [...area.querySelectorAll('svg.nbl-chart')].map(svg => {
            const r = svg.getBoundingClientRect();
            return [...svg.querySelectorAll('text')].every(t => t.getBoundingClientRect().left >= r.left - 1);
        }),
        buttons: [...area.querySelectorAll('button')].filter(b => b.offsetParent).map(
            b => ({text: b.innerText.trim(), cut: b.scrollWidth > b.clientWidth + 1})),
        staleShown: [...area.querySelectorAll('.nbl-stale')].some(e => parseFloat(getComputedStyle(e).fontSize) > 0),
        stacksPanes: area.querySelectorAll('.nbl-stacks').length,
        splits: [...area.querySelectorAll('.nbl-split')].map(e => ({
            view: e.closest('.nbl-summary') ? 'summary' : 'dashboard', step: Number(e.dataset.step),
            parts: [...e.querySelectorAll('.nbl-part')].map(p => p.dataset.part), ...box(e),
            inCell: e.getBoundingClientRect().right <= e.closest('td').getBoundingClientRect().right + 1})),
        findings: [...area.querySelectorAll('.nbl-finding')].map(e => e.innerText),
        stepSummaries: [...area.querySelectorAll('.nbl-steps')].map(e => ({
            straggler: e.dataset.straggler, cause: e.dataset.cause, text: e.innerText})),
    };
}"""


# -- driving the notebook -----------------------------------------------------------------------


class Scenarios:
    """The page, the notebook in it, and what each scenario looked like."""

    def __init__(self, page, artifacts: Path):
        self.page = page
        self.artifacts = artifacts
        self.seen: dict[str, dict] = {}  # scenario -> OBSERVE of its cell(s)
        self.times: dict[str, float] = {}
        self.notes: list[str] = []  # soft waits that ran out (older code)
        self.errors: list[str] = []  # the page's uncaught errors
        self._started: dict[str, float] = {}

    def run(self, cell_id: str) -> None:
        self._started[cell_id] = time.monotonic()
        self.page.evaluate(RUN_CELL, cell_id)

    def run_and_wait(self, cell_id: str) -> None:
        self.run(cell_id)
        self.wait_ran(cell_id)

    def wait_ran(self, cell_id: str) -> None:
        self.page.wait_for_function(CELL_RAN, arg=cell_id, timeout=CELL_S * 1000)
        self.times[cell_id] = round(time.monotonic() - self._started[cell_id], 2)

    def wait(self, condition: str, cell_id: str, timeout_s: float = CELL_S) -> None:
        self.page.wait_for_function(condition, arg=cell_id, timeout=timeout_s * 1000)

    def soft_wait(self, condition: str, cell_id: str, what: str) -> bool:
        """Wait for an end state that older code may never reach: note it and go on to the screenshot."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.wait(condition, cell_id, SOFT_S)
            return True
        except PlaywrightTimeout:
            self.notes.append(f"{cell_id}: no {what} within {SOFT_S} s")
            return False

    def shoot_running_then_over(self, cell_id: str, live: str, running: str, over: str, what: str,
                                finished: str) -> None:
        """Run a launch cell: once ``live`` holds, shoot ``running``; once the cell ran and
        (softly) ``over`` holds, shoot ``finished``."""
        self.run(cell_id)
        self.wait(live, cell_id)
        self.shoot(running, [cell_id])
        self.wait_ran(cell_id)
        self.soft_wait(over, cell_id, what)
        self.shoot(finished, [cell_id])

    def shoot(self, name: str, cell_ids: list[str]) -> None:
        """scenario_<name>.png (the window), scenario_<name>_cell.png (the cells) and .json."""
        page = self.page
        fit = page.evaluate(SCROLL_TO, cell_ids)
        page.screenshot(path=str(self.artifacts / f"scenario_{name}.png"), full_page=True)
        if not fit["fits"]:  # make the window taller for the cropped picture, then as it was
            height = min(MAX_HEIGHT, fit["windowHeight"] + fit["needed"] - fit["room"] + 24)
            page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
            page.wait_for_function(f"(ids) => ({SCROLL_TO})(ids).fits || window.innerHeight >= {MAX_HEIGHT}",
                                   arg=cell_ids, timeout=10_000)
        page.screenshot(path=str(self.artifacts / f"scenario_{name}_cell.png"), clip=page.evaluate(CLIP, cell_ids))
        seen = {cell_id: page.evaluate(OBSERVE, cell_id) for cell_id in cell_ids}
        if not fit["fits"]:
            page.set_viewport_size(VIEWPORT)
        self.seen[name] = seen
        record = {
            cell_id: {k: v for k, v in s.items() if k != "text"}
            | {"occurrences": {needle: s["text"].count(needle) for needle in NEEDLES}}
            for cell_id, s in seen.items()
        }
        (self.artifacts / f"scenario_{name}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False))


@pytest.fixture(scope="module")
def scenarios(lab, browser):
    """Runs every scenario and takes its screenshots; asserts nothing about nblaunch's display."""
    base, token, root = lab
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    # Every cell stays in the DOM (no windowing), so offscreen cells can be measured and shot.
    tracker = root / ".config/lab/user-settings/@jupyterlab/notebook-extension/tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True, exist_ok=True)
    tracker.write_text('{"windowingMode": "none"}')
    cells = json.loads(NOTEBOOK.read_text())["cells"]

    page = browser.new_page(viewport=VIEWPORT)
    s = Scenarios(page, ARTIFACTS)
    page.on("pageerror", lambda error: s.errors.append(str(error)))
    started = time.monotonic()
    try:
        page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
        page.wait_for_function(KERNEL_IDLE, timeout=120_000)
        page.wait_for_function(MARK_CELLS, arg=len(cells), timeout=30_000)

        # The kernel must import the nblaunch of this checkout (PYTHONPATH before an editable install).
        s.run_and_wait("imports")
        imported = page.evaluate(CELL_TEXT, "imports")
        assert f"nblaunch imported from {ROOT / 'nblaunch'}/" in imported, imported
        s.run_and_wait("def-train-long")

        # A long blocking launch: part-way, then over.
        s.shoot_running_then_over("launch-long", BAR_PART_WAY, "running", ONE_VIEW,
                                  "summary in place of the dashboard", "finished")

        # The step split: rank 1 starved of data, named live, then in the summary.
        s.run_and_wait("def-train-split")
        s.shoot_running_then_over("launch-split", SPLIT_SHOWN, "split_running", SPLIT_SUMMARY,
                                  "step split in the summary", "split_finished")

        # A failed launch: rank 1 raises, rank 0 is stopped.
        s.run_and_wait("def-fails")
        s.run_and_wait("launch-fails")
        s.soft_wait(HAS_SUMMARY, "launch-fails", "summary")
        s.shoot("failed", ["launch-fails"])

        # An interrupted launch: the kernel is interrupted once both ranks run.
        s.run_and_wait("def-waits")
        s.run("launch-waits")
        s.wait(BOTH_RANKS_RUNNING, "launch-waits")
        page.evaluate(INTERRUPT)
        s.wait_ran("launch-waits")
        s.soft_wait(HAS_SUMMARY, "launch-waits", "summary")
        s.shoot("interrupted", ["launch-waits"])

        # A non-blocking launch: the cell returns at once, the dashboard goes on; then result().
        s.run_and_wait("launch-nonblocking")
        s.wait(BAR_PART_WAY, "launch-nonblocking")
        s.shoot("nonblocking_running", ["launch-nonblocking"])
        if s.soft_wait(CLICK_STACKS.replace(".click()", " !== undefined"), "launch-nonblocking", "Stacks button"):
            page.evaluate(CLICK_STACKS, "launch-nonblocking")
            s.soft_wait(STACKS_SHOWN, "launch-nonblocking", "stacks after the click")
            s.shoot("nonblocking_stacks", ["launch-nonblocking"])
        s.run_and_wait("nonblocking-result")
        s.soft_wait(ONE_VIEW, "launch-nonblocking", "summary in place of the dashboard")
        s.shoot("nonblocking_finished", ["launch-nonblocking", "nonblocking-result"])

        # Last (the kernel is gone after it): a restart under a running launch.
        s.run("launch-restart")
        s.wait(BOTH_RANKS_RUNNING, "launch-restart")
        page.evaluate(RESTART)
        s.wait_ran("launch-restart")
        s.soft_wait(STALE_SHOWN, "launch-restart", "'not updated since' note")
        s.shoot("kernel_restarted", ["launch-restart"])
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / "scenario_error.png"), full_page=True)
        raise
    s.times["all"] = round(time.monotonic() - started, 2)
    (ARTIFACTS / "scenario_times.json").write_text(json.dumps({"seconds": s.times, "notes": s.notes}, indent=1))
    yield s
    page.close()


# -- what the scenarios must show ---------------------------------------------------------------


def test_a_finished_launch_leaves_one_summary_and_no_dashboard(scenarios):
    seen = scenarios.seen["finished"]["launch-long"]
    assert len(seen["summaries"]) == 1, seen["summaries"]
    assert seen["summaries"][0]["state"] == "done"
    assert seen["dashboards"] == 0


def test_the_step_split_shows_live_in_each_rank_row_and_names_the_starved_rank(scenarios):
    running = scenarios.seen["split_running"]["launch-split"]
    bars = [b for b in running["splits"] if b["view"] == "dashboard"]
    assert len(bars) == 2 and all(b["parts"] == ["data", "compute", "communication", "optimizer", "other"]
                                  for b in bars), bars
    assert all(b["inCell"] and b["width"] > 0 for b in bars), bars
    assert running["ranksFit"] == [True], "the rank table is wider than its box"
    assert not [o for o in running["overflowing"] if "nblaunch-dashboard" in o["element"]], running["overflowing"]
    assert any("rank 1 holds the others up: it waits" in f and "for data" in f for f in running["findings"])
    finished = scenarios.seen["split_finished"]["launch-split"]
    assert [(s["straggler"], s["cause"]) for s in finished["stepSummaries"]] == [("1", "data")], finished
    assert "num_workers" in finished["stepSummaries"][0]["text"]
    assert "samples/s in all" in finished["visibleText"]


def test_a_failed_launch_shows_the_error_once_without_launcher_paths(scenarios):
    seen = scenarios.seen["failed"]["launch-fails"]
    assert "bad batch shape" in seen["text"]
    assert "check_batch" in seen["text"]  # the rank's own traceback: the helper's frame
    assert "nblaunch/" not in seen["text"], [line for line in seen["text"].splitlines() if "nblaunch/" in line]


def test_an_interrupted_launch_shows_its_ranks_stopped(scenarios):
    seen = scenarios.seen["interrupted"]["launch-waits"]
    assert seen["summaries"], "no summary after the interrupt"
    states = {row["state"] for row in seen["ranks"] if row["view"] == "summary"}
    summary = seen["summaries"][0]
    assert summary["state"] in ("interrupted", "stopped") or states <= {"interrupted", "stopped"}, (summary, states)
    assert "interrupted" in seen["visibleText"]


def test_a_nonblocking_launch_returns_at_once_and_ends_in_one_summary(scenarios):
    running = scenarios.seen["nonblocking_running"]["launch-nonblocking"]
    assert "<Launch train_long" in running["text"]  # the cell's value: the handle's repr
    finished = scenarios.seen["nonblocking_finished"]
    assert len(finished["launch-nonblocking"]["summaries"]) == 1
    assert finished["launch-nonblocking"]["dashboards"] == 0
    assert "[0, 10]" in finished["nonblocking-result"]["text"]


@pytest.mark.parametrize("scenario, cell", [
    ("running", "launch-long"), ("finished", "launch-long"), ("nonblocking_running", "launch-nonblocking")])
def test_the_rank_table_and_charts_fit_with_long_descriptions_and_lines(scenarios, scenario, cell):
    seen = scenarios.seen[scenario][cell]
    assert seen["ranksFit"] and all(seen["ranksFit"]), "the rank table is wider than the cell"
    assert seen["barsInCells"] and all(seen["barsInCells"]), "a progress bar's text runs out of its column"
    assert seen["chartLabelsInside"] and all(seen["chartLabelsInside"]), "a chart's axis label is cut on the left"
    assert not [b for b in seen["buttons"] if b["cut"]], seen["buttons"]


def test_a_nonblocking_launch_has_whole_buttons_and_stacks_on_demand(scenarios):
    running = scenarios.seen["nonblocking_running"]["launch-nonblocking"]
    assert [b["text"] for b in running["buttons"]] == ["Stacks", "Stop"]
    assert re.search(r"(starting|running) when shown", running["text"])  # the repr does not pretend to be live
    stacks = scenarios.seen["nonblocking_stacks"]["launch-nonblocking"]
    assert stacks["stacksPanes"] == 1 and "the launch goes on" in stacks["visibleText"]


def test_a_dashboard_whose_kernel_restarted_stops_claiming_to_run(scenarios):
    seen = scenarios.seen["kernel_restarted"]["launch-restart"]
    assert seen["staleShown"], "the dead launch's dashboard still looks live"
    assert "not updated since" in seen["visibleText"]


def test_no_errors_in_the_page(scenarios):
    assert scenarios.errors == [], scenarios.errors
