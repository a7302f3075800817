"""What a launch raises, and why.

- :class:`LaunchConfigError`: bad input, raised before any process starts.
- :class:`RankFailedError`: one or more ranks failed (each a
  :class:`~nblaunch.contract.failure.RankFailure`); the root cause, chosen in one place
  (:meth:`RankFailedError.blaming`), comes first, and its exception (with its remote traceback)
  is chained as ``__cause__``.
- :class:`LaunchTimeoutError`: ``timeout=`` ran out; carries every rank's stack.
- :class:`LaunchCancelledError`: a non-blocking launch was cancelled.
- :class:`LaunchInterrupted`: interrupted (a ``KeyboardInterrupt``); every rank was stopped.

:func:`failure_from_exit` says how a rank failed from how its process ended (a rank's own
report arrives as a ``RankFailure`` already).
"""

from __future__ import annotations

import dataclasses

import concurrent.futures
import re
import signal

from nblaunch import frames
from nblaunch.contract.failure import Phase, RankFailure, RemoteTraceback


class LaunchConfigError(ValueError):
    """The launch was refused before any process started; the message says what to change."""


_COLLECTIVE = re.compile(r'distributed_c10d\.py", line \d+, in (\w+)')

UNEVEN_WORK_HINT = (
    "This is the usual sign of uneven work: the ranks ran different numbers of steps or batches. "
    "Give every rank the same number of batches (a prepared DataLoader does, with even_batches=True; "
    "or drop_last=True), or let ranks that run out wait for the others with "
    "Accelerator.join_uneven_inputs / torch.distributed.algorithms.Join."
)


class RankFailedError(RuntimeError):
    """One or more ranks failed. ``failures[0]`` is the root cause (the first to fail).

    Example::

        try:
            notebook_launcher(train, num_processes=2)
        except RankFailedError as err:
            print(err.root_cause.rank, err.root_cause.reason)
    """

    def __init__(self, failures: list[RankFailure], stacks: dict[int, str] | None = None):
        self.failures = failures
        self.stacks = stacks or {}
        super().__init__(self._message())
        root = failures[0]
        if root.exception is not None and root.exception.__cause__ is None and root.traceback:
            root.exception.__cause__ = RemoteTraceback(root.traceback)  # lost when it was pickled
        self.__cause__ = root.exception  # the rank's own exception, its traceback below it

    def __reduce__(self):  # pickled whole: a detached launch's outcome crosses processes
        return (type(self), (self.failures, self.stacks))

    @classmethod
    def blaming(cls, failures: list[RankFailure], stacks: dict[int, str], shown_failing: list[int],
                finished: list[int]) -> "RankFailedError":
        """The error of a launch whose ranks ``failures`` failed (in the order they did), wherever
        they ran: the one place the root cause is chosen.

        A rank's own error comes before the errors a dead peer caused (``collateral``), then the
        order in which the display showed the ranks failing (``shown_failing``), so that what the
        user saw first is what is blamed (ranks failing on the same line differ by a millisecond
        either way). When every failure is a lost peer and some ranks ``finished`` normally, no
        one broke: the root cause says that they left while it still waited for them.
        """
        shown = {rank: i for i, rank in enumerate(shown_failing)}
        ordered = sorted(failures, key=lambda f: (f.collateral, shown.get(f.rank, len(shown))))  # stable
        root = ordered[0]
        if root.collateral and finished:
            found = _COLLECTIVE.findall(root.traceback)
            where = f"in {found[-1]}()" if found else "in a collective"
            who = " and ".join(f"rank {r}" for r in finished)
            root.reason = f"still {where} when {who} finished and left: {root.reason}"
            root.hint = UNEVEN_WORK_HINT
        return cls(ordered, stacks)

    @property
    def root_cause(self) -> RankFailure:
        return self.failures[0]

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    def _message(self) -> str:
        # The headline; the traceback is not repeated here: it is chained below (``__cause__``).
        first = self.failures[0]
        place = frames.where(first.traceback, with_code=False) if first.traceback else ""
        lines = [f"rank {first.rank} failed: {first.reason}" + (f" ({place})" if place else "")]
        if first.hint:
            lines += ["", first.hint]
        if first.log_tail:
            lines += ["", f"last lines of rank {first.rank}:"] + [f"  {t}" for t in first.log_tail]
        for other in self.failures[1:]:
            note = " (likely a consequence of rank %d)" % first.rank if other.collateral else ""
            lines.append(f"rank {other.rank} also failed{note}: {other.reason}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class KeptWork:
    """What a stopped launch kept: every rank stopped after ``steps`` training steps and saved its
    state in ``checkpoint`` (``launch.kept`` on the error an interrupt, a timeout or a cancel raised)."""

    steps: int
    checkpoint: str

    def __str__(self) -> str:
        return (f"every rank stopped after {self.steps} training steps and saved its state in {self.checkpoint}; "
                "go on from there with notebook_launcher(..., resume=True), or in a terminal the same command with "
                "--resume")


class LaunchInterrupted(KeyboardInterrupt):
    """The launch was interrupted (the kernel's ■, Ctrl-C); every rank was stopped first. A
    ``KeyboardInterrupt``, so code that catches that goes on working. ``kept``: where the ranks
    saved their work, when they trained under nblaunch's Accelerator (else None)."""

    kept: KeptWork | None = None


class LaunchCancelledError(concurrent.futures.CancelledError):
    """A non-blocking launch was stopped with ``cancel()`` (or the widget's Stop button);
    ``kept`` as for ``LaunchInterrupted``."""

    kept: KeptWork | None = None


class LaunchTimeoutError(TimeoutError):
    """The launch ran past ``timeout=``; every rank was stopped. ``stacks`` says where each was;
    ``kept`` as for ``LaunchInterrupted``."""

    kept: KeptWork | None = None

    def __init__(self, timeout: float, stacks: dict[int, str]):
        self.timeout = timeout
        self.stacks = stacks
        # One line per rank; the whole stacks are in ``stacks``, the display and the logs.
        where = "\n".join(f"  rank {r}: {frames.where(text) or '(no stack)'}" for r, text in sorted(stacks.items()))
        super().__init__(
            f"the launch did not finish within timeout={timeout:g} s; every rank was stopped."
            + (f"\nWhere the ranks were:\n{where}" if where else "")
        )

    def __reduce__(self):  # pickled whole: a detached launch's outcome crosses processes
        return (type(self), (self.timeout, self.stacks))


def failure_from_exit(rank: int, code: int, tail: list[str], cause: str | None = None,
                      oom_killed: bool | None = None) -> RankFailure:
    """How rank ``rank`` failed, from its exit ``code``, the last lines it wrote and, where the
    launcher knows it, what killed it (``cause``: its launch server died; ``oom_killed``: whether
    the machine's count of out-of-memory kills rose during the launch, None where it cannot say)."""
    if code < 0:
        name = signal.Signals(-code).name
        reason = f"killed by {name}"
        if cause is not None:
            reason += f": {cause}"
        elif -code == signal.SIGKILL:
            reason += {
                True: ": the out-of-memory killer stopped it (this machine's count of out-of-memory kills rose "
                      "during the launch): the ranks need less memory (a smaller batch or model, fewer ranks)",
                False: " (not by the out-of-memory killer: this machine's count of its kills did not rise; "
                       "the signal came from a process: the rank's own code, another program, a scheduler)",
                None: " (the out-of-memory killer, or a process that sent it: this machine does not say which)",
            }[oom_killed]
        return RankFailure(rank, reason, phase=Phase.ENDED, exitcode=code, signal_name=name, log_tail=tail)
    if code == 0:
        reason = "exited with code 0 without returning (os._exit in the function?)"
    else:
        reason = f"exited with code {code}" + ("" if tail else " without a report and without writing anything")
    return RankFailure(rank, reason, phase=Phase.ENDED, exitcode=code, log_tail=tail)
