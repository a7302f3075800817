"""notebooks/widget_demo.ipynb executed in a real ipykernel: the dashboard as a frontend receives it.

The kernel's main thread is busy in the blocking launch the whole time, so every widget update
seen before the launch ends proves that updates reach the frontend from the display's thread.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from htmlq import bars, chart_points, rank_states, text
from nbclient import NotebookClient

pytest.importorskip("tqdm")

NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "widget_demo.ipynb"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class RecordingClient(NotebookClient):
    """Keeps every widget state update, in order, as the frontend would apply them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates: list[dict] = []

    def handle_comm_msg(self, outs, msg, cell_index):
        super().handle_comm_msg(outs, msg, cell_index)
        data = msg["content"].get("data", {})
        if data.get("method") == "update":
            self.updates.append(data.get("state", {}))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = RecordingClient(
        nb, timeout=180, kernel_name="python3", store_widget_state=True,
        resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}},
    )
    client.execute()
    return nb, client.updates


def widget_values(nb) -> list[str]:
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    return [m["state"]["value"] for m in state.values() if m["model_name"] == "HTMLModel"]


def part(values: list[str], marker: str) -> str:
    (found,) = [v for v in values if marker in v]
    return found


def test_the_saved_widget_state_shows_the_whole_launch(executed):
    nb, _ = executed
    values = widget_values(nb)
    ranks = part(values, 'class="nbl-ranks"')
    assert rank_states(ranks) == {0: "done", 1: "done"}
    assert bars(ranks) == [(40.0, 40.0), (40.0, 40.0)]  # tqdm in the workers, drawn here
    assert 'data-state="done"' in part(values, 'class="nbl-header"')
    logs = {r: text(part(values, f'class="nbl-log" data-rank="{r}"')) for r in ("0", "1", "all")}
    assert "rank 0 step 39" in logs["0"] and "rank 1 step 39" in logs["1"]
    assert "rank 0 step 39" in logs["all"] and "rank 1 step 39" in logs["all"]
    assert "%|" not in logs["all"]  # tqdm drew nothing into the logs
    assert chart_points(part(values, 'class="nbl-metrics-panel"'), "loss") == {"rank 0": 40, "rank 1": 40}
    assert tab_titles(nb) == ["all ranks", "rank 0", "rank 1"]


def tab_titles(nb) -> list[str]:
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    (tab,) = [m["state"] for m in state.values() if m["model_name"] == "TabModel"]
    if "titles" in tab:  # ipywidgets 8
        return list(tab["titles"])
    return [tab["_titles"][str(i)] for i in range(len(tab["_titles"]))]  # ipywidgets 7


def test_the_dashboard_updated_while_the_launch_ran(executed):
    _, updates = executed
    ranks_updates = [u["value"] for u in updates if 'class="nbl-ranks"' in u.get("value", "")]
    live = [v for v in ranks_updates if set(rank_states(v).values()) == {"running"}]
    moving = {n for v in live for n, total in bars(v) if total and 0 < n < total}
    assert len(moving) >= 3, "the progress bars should have been seen moving"
    charts = [u["value"] for u in updates if 'class="nbl-metrics-panel"' in u.get("value", "")]
    # The first chart may hold one rank's line only: whichever rank logged first.
    assert len(charts) >= 3 and sum(chart_points(charts[0], "loss").values()) < 80


def test_the_finished_cell_keeps_one_view_the_static_summary(executed):
    nb, _ = executed
    outputs = nb.cells[-1].outputs
    # The summary took the widget's place: no widget a saved notebook could not draw.
    assert not any(WIDGET_VIEW in o.get("data", {}) for o in outputs)
    assert len([o for o in outputs if o.output_type == "display_data"]) == 1
    summaries = [o["data"]["text/html"] for o in outputs if "nbl-summary" in o.get("data", {}).get("text/html", "")]
    assert len(summaries) == 1
    summary = summaries[0]
    assert 'class="nbl-summary" data-state="done"' in summary
    assert rank_states(summary) == {0: "done", 1: "done"}
    assert chart_points(summary, "loss") == {"rank 0": 40, "rank 1": 40}
    assert "rank 1 step 39" in text(summary)
    assert "[0, 10]" in outputs[-1]["data"]["text/plain"]  # the launch's return value


BACKGROUND_LAUNCH = [
    "import threading\n"
    "from nblaunch import notebook_launcher\n"
    "from nblaunch.display.widget import WidgetDisplay\n"
    "\n"
    "def train():\n"
    "    import os, time\n"
    "    for step in range(30):\n"
    "        print(f\"rank {os.environ['RANK']} step {step}\")\n"
    "        time.sleep(0.03)\n"
    "\n"
    "# Made on the cell's thread, as a non-blocking launch must; knowing the ranks, all its widgets too.\n"
    "dashboard = WidgetDisplay(num_processes=2)\n"
    "launch = threading.Thread(target=notebook_launcher, args=(train,),\n"
    "                          kwargs=dict(num_processes=2, display=dashboard))\n"
    "launch.start()",
    "launch.join()",
]


@pytest.mark.slow
def test_updates_after_the_launching_cell_finished_land_in_that_cell(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in BACKGROUND_LAUNCH]
    NotebookClient(
        nb, timeout=180, kernel_name="python3", store_widget_state=True,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()

    launching, waiting = nb.cells
    assert waiting.outputs == []  # nothing leaked into the cell that happened to be running
    summary = [o["data"]["text/html"] for o in launching.outputs if "nbl-summary" in o.get("data", {}).get("text/html", "")]
    assert len(summary) == 1 and rank_states(summary[0]) == {0: "done", 1: "done"}
    values = widget_values(nb)
    assert rank_states(part(values, 'class="nbl-ranks"')) == {0: "done", 1: "done"}
    assert "rank 1 step 29" in text(part(values, 'class="nbl-log" data-rank="1"'))
