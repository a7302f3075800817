"""Where a rank is, as one line: the innermost frame of the user's own code."""

from __future__ import annotations

import sysconfig

from nblaunch import frames

SITE = sysconfig.get_paths()["purelib"]


def stack(*frames_: tuple[str, int, str, str]) -> str:
    lines = ["Thread MainThread (most recent call last):"]
    for path, line, function, code in frames_:
        lines.append(f'  File "{path}", line {line}, in {function}')
        if code:
            lines.append(f"    {code}")
    return "\n".join(lines) + "\n"


def test_the_users_innermost_frame_is_where_the_rank_is():
    text = stack(("<frozen runpy>", 88, "_run_code", ""), ("/home/me/train.py", 12, "<module>", "main()"),
                 ("/home/me/train.py", 7, "main", "loss.backward()"), (f"{SITE}/torch/autograd/__init__.py", 3, "backward", "x"))
    assert frames.where(text) == "train.py, line 7, in main: loss.backward()"


def test_pythons_frozen_modules_are_not_the_users_code():
    # A script that lives among installed packages (Accelerate's own test scripts): no frame is the
    # user's, so the innermost one is shown, never the runpy frame that started the script.
    text = stack(("<frozen runpy>", 88, "_run_code", ""), (f"{SITE}/accelerate/scripts/loop.py", 173, "test", "ddp(x)"),
                 (f"{SITE}/torch/nn/parallel/distributed.py", 1775, "_pre_forward", "self.reducer._rebuild_buckets()"))
    assert frames.where(text) == "distributed.py, line 1775, in _pre_forward: self.reducer._rebuild_buckets()"
    assert not frames.is_users("<frozen runpy>")


def test_nblaunchs_own_frames_come_last():
    # A rank stopped while nblaunch sends its output: where the user's library call was.
    package = frames._PACKAGE
    text = stack((f"{SITE}/torch/distributed/c10d.py", 9, "all_reduce", "work.wait()"),
                 (f"{package}/wire.py", 53, "write_all", "written = os.write(fd, view)"))
    assert frames.where(text) == "c10d.py, line 9, in all_reduce: work.wait()"
