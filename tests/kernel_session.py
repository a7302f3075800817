"""A real Jupyter kernel driven cell by cell, interrupts included (what nbclient cannot time)."""

from __future__ import annotations

import ast
import os
import time
from dataclasses import dataclass, field

from jupyter_client.manager import start_new_kernel


@dataclass
class Ran:
    """What one cell showed: its streams, its value, its error, and when each came."""

    text: str = ""
    value: str | None = None
    error: tuple[str, str] | None = None  # (ename, evalue)
    took: float = 0.0
    lines_at: list[tuple[float, str]] = field(default_factory=list)  # (seconds since the cell began, text)
    traceback: str = ""

    @property
    def result(self):
        return ast.literal_eval(self.value) if self.value is not None else None


class KernelSession:
    def __init__(self, cwd: str) -> None:
        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=cwd)
        self.cwd = cwd

    def run(self, code: str, *, interrupt_when: list[str] | None = None, interrupts: int = 1,
            interrupt_after: float | None = None, timeout: float = 180, answers: list[str] | None = None) -> Ran:
        """Run ``code``; interrupt the kernel once the files ``interrupt_when`` exist (or after
        ``interrupt_after`` s), ``interrupts`` times in a row; answer each prompt for input
        (pdb's) with the next of ``answers``, as a person types them."""
        began = time.monotonic()
        answers = list(answers or [])
        msg_id = self.kc.execute(code, allow_stdin=bool(answers))
        ran, idle, interrupted = Ran(), False, interrupt_when is None and interrupt_after is None
        while not idle:
            if answers:
                try:
                    request = self.kc.get_stdin_msg(timeout=0.01)
                except Exception:
                    request = None
                if request is not None and request["msg_type"] == "input_request":
                    ran.text += request["content"]["prompt"]
                    self.kc.input(answers.pop(0))
            if not interrupted:
                due = (all(os.path.exists(os.path.join(self.cwd, f)) for f in interrupt_when) if interrupt_when
                       else time.monotonic() - began >= interrupt_after)
                if due:
                    for _ in range(interrupts):
                        self.km.interrupt_kernel()
                    interrupted = True
            if time.monotonic() - began > timeout:
                raise TimeoutError(f"the cell did not finish in {timeout} s: {code!r}; shown so far: {ran.text}")
            try:
                message = self.kc.get_iopub_msg(timeout=0.05)
            except Exception:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                ran.text += content["text"]
                ran.lines_at.append((time.monotonic() - began, content["text"]))
            elif kind == "execute_result":
                ran.value = content["data"].get("text/plain")
            elif kind == "display_data":
                ran.text += content["data"].get("text/plain", "")
            elif kind == "error":
                ran.error = (content["ename"], content["evalue"])
                ran.traceback = "\n".join(content.get("traceback", []))
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        ran.took = time.monotonic() - began
        return ran

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
