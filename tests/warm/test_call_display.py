"""A call on warm ranks shows its dashboard only when it runs a while (issue 60): a quick
``%%distributed`` cell shows one line and then its summary, no widget made (making one cost such
a cell more than the call); a cell still running after ``CALL_DASHBOARD_AFTER_S`` gets the
dashboard in that line's place, and the summary at its end. In a real kernel, every message
its cells sent read off IOPub."""

from __future__ import annotations

import tempfile

import pytest

from nblaunch.warm.call_router import CALL_DASHBOARD_AFTER_S


@pytest.fixture(scope="module")
def cells():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=tempfile.mkdtemp(prefix="nbl-calls-"))

    def run(code: str) -> list[dict]:
        sent: list[dict] = []
        reply = kc.execute_interactive(code, timeout=180, output_hook=sent.append)
        assert reply["content"]["status"] == "ok", reply["content"]
        return sent

    try:  # every cell run, and the kernel (and its ranks) gone, before the first test
        run("%load_ext nblaunch")
        run("%%distributed -n 2 --cpu\nimport time\nx = 1")
        return {"quick": run("%%distributed\nx + 1"),
                "long": run(f"%%distributed\ntime.sleep({CALL_DASHBOARD_AFTER_S * 4})\nprint('slept')\nx + 2")}
    finally:
        run("%distributed stop")
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def widgets_opened(messages: list[dict]) -> int:
    return sum(m["msg_type"] == "comm_open" and m["content"].get("target_name") == "jupyter.widget" for m in messages)


def shown(messages: list[dict], kind: str) -> list[dict]:
    return [m["content"]["data"] for m in messages if m["msg_type"] == kind]


def test_a_quick_call_shows_a_line_then_its_summary_and_makes_no_widget(cells):
    messages = cells["quick"]
    assert widgets_opened(messages) == 0
    [first] = shown(messages, "display_data")
    assert "nblaunch: running" in first["text/html"]
    last = shown(messages, "update_display_data")[-1]
    assert "all 2 ranks done" in last["text/html"] and "[2, 2]" in str(shown(messages, "execute_result"))


def test_a_call_still_running_gets_the_dashboard_in_the_lines_place_then_its_summary(cells):
    messages = cells["long"]
    assert widgets_opened(messages) > 0
    updates = shown(messages, "update_display_data")
    assert any("application/vnd.jupyter.widget-view+json" in u for u in updates)  # the dashboard, in place
    assert "slept" in updates[-1]["text/html"] and "all 2 ranks done" in updates[-1]["text/html"]
