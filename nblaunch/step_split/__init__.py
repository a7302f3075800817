"""Why a launch is slow: each rank's training steps split into their parts, the rank that holds
the others up, and what the ranks buy together.

Both ends agree on it here. A rank's clock (``nblaunch.worker.step_clock``) sends its steps as
:data:`~nblaunch.step_split.book.StepRecord` tuples (``StepTimes`` events); a :class:`StepBook`
on the launcher's side keeps them, lines the ranks' gradient syncs up and makes a
:class:`LaunchSteps` report, which the handle returns (``launch.steps``) and the displays show;
the one of the launch that ended last stays for ``nblaunch.last_steps()`` (``latest``).

Example::

    book = StepBook(num_ranks=2)
    book.add(0, [(1, 0.030, 0.000, 0.005, 0.024, 0.001, 0.024, 8)])
    book.add(1, [(1, 0.030, 0.024, 0.005, 0.000, 0.001, 0.000, 8)])
    report = book.report()
    report.straggler, report.cause      # (1, "data")
    print(report)                        # the summary, in words
"""

from nblaunch.step_split.book import StepBook, StepRecord
from nblaunch.step_split.latest import last_steps, remember
from nblaunch.step_split.launch_steps import LaunchSteps, RankSteps

__all__ = ["LaunchSteps", "RankSteps", "StepBook", "StepRecord", "last_steps", "remember"]
