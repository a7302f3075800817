"""The launcher's book of the ranks' steps and its verdict (``nblaunch.step_split``), from records
as ranks send them; the stall's count line (``launch/supervising/stall``)."""

from __future__ import annotations

import pytest

from nblaunch.launch.supervising.stall import counted_line, verdict
from nblaunch.step_split import StepBook


def _record(index, data=0.0, compute=0.005, communication=0.0, optimizer=0.001, other=0.0, wait=None, samples=8):
    step = data + compute + communication + optimizer + other
    return (index, step, data, compute, communication, optimizer, communication if wait is None else wait, samples)


def test_the_arrival_lag_comes_from_the_waits_in_each_sync_without_comparing_clocks():
    book = StepBook(num_ranks=3)
    for i in range(1, 11):
        book.add(0, [_record(i, communication=0.030)])  # first to arrive: waits longest
        book.add(1, [_record(i, communication=0.020)])
        book.add(2, [_record(i, data=0.030, communication=0.0)])  # last: waits for no one
    report = book.report()
    assert report[0].arrival_lag == pytest.approx(0.0)
    assert report[1].arrival_lag == pytest.approx(0.010)
    assert report[2].arrival_lag == pytest.approx(0.030)
    assert report.straggler == 2 and report.cause == "data"
    assert "ranks 0, 1 wait" in report.finding


def test_a_sync_is_lined_up_only_once_every_rank_took_it():
    book = StepBook(num_ranks=2)
    book.add(0, [_record(i, communication=0.02) for i in range(1, 6)])
    assert book.report()[0].arrival_lag is None  # rank 1 has not said yet
    book.add(1, [_record(i) for i in range(1, 6)])
    assert book.report()[1].arrival_lag == pytest.approx(0.02)


def test_a_rank_late_by_its_own_code_is_compute_and_small_lags_name_no_one():
    book = StepBook(num_ranks=2)
    for i in range(1, 21):
        book.add(0, [_record(i, communication=0.0201)])
        book.add(1, [_record(i, other=0.020, communication=0.0001)])
    report = book.report()
    assert (report.straggler, report.cause) == (1, "compute")
    assert "its own code between the steps" in report.finding
    even = StepBook(num_ranks=2)
    for i in range(1, 21):
        even.add(0, [_record(i, communication=0.0004)])
        even.add(1, [_record(i, communication=0.0001)])
    assert even.report().straggler is None and even.report().cause is None  # 0.3 ms: under 1 ms


def test_ranks_slower_together_than_one_alone_are_flagged():
    book = StepBook(num_ranks=2)
    for i in range(1, 11):
        for rank in (0, 1):
            book.add(rank, [_record(i, compute=0.002, communication=0.030)])
    report = book.report()
    assert report.cause == "communication" and report.slower_than_one
    assert "slower than one rank alone" in report.buys and "communication takes" in report.finding
    assert "steps split: 10 steps per rank" in str(report)


def test_the_live_view_reads_the_last_steps_and_a_restart_forgets_them():
    book = StepBook(num_ranks=1)
    book.add(0, [_record(i, data=0.050) for i in range(1, 101)] + [_record(i) for i in range(101, 121)])
    assert book.report()[0].data == pytest.approx(0.050)
    assert book.report(recent=20)[0].data == pytest.approx(0.0)
    assert book.report()[0].count == 120
    book.clear()
    assert len(book.report()) == 0


def test_a_note_is_said_once_and_a_rank_not_measured_is_named():
    book = StepBook(num_ranks=2)
    book.note("the step split needs nblaunch's Accelerator")
    book.note("the step split needs nblaunch's Accelerator")
    report = book.report()
    assert report.notes == ("the step split needs nblaunch's Accelerator",)
    assert str(report) == "the step split needs nblaunch's Accelerator"
    with pytest.raises(KeyError, match="rank 3 measured no steps"):
        report[3]


def test_a_stall_is_told_by_count_where_stacks_cannot_tell():
    stacks = {0: 'File "train.py", line 70, in train\n', 1: 'File "train.py", line 71, in train\n'}
    counts = {0: {"gradient sync": (7, 6)}, 1: {"gradient sync": (6, 6)}}
    line = counted_line(counts, stacks)
    assert line.startswith("rank 0 waits in its 7th gradient sync; rank 1 has entered 6")
    assert counted_line({0: {"gather": (2, 2)}, 1: {"gather": (2, 2)}}, stacks) == ""
    assert "7th gradient sync" in verdict(stacks, 60.0, counts)
    assert counted_line({0: {"barrier": (3, 2)}, 1: {"barrier": (3, 2)}, 2: {"barrier": (2, 2)}}, {}) == (
        "ranks 0, 1 wait in their 3rd barrier; rank 2 has entered 2")


def test_a_rank_late_by_chance_is_no_straggler_when_nothing_in_its_step_explains_it():
    """CI's numbers: a communication-bound step on a shared CPU, rank 0 arriving 5.3 ms late (15 % of
    its step) though its own parts take only 1.7 ms longer: the scheduler's, not a slow rank's."""
    from nblaunch.step_split.launch_steps import RankSteps
    from nblaunch.step_split.verdict import judge

    def rank(index, compute, communication, lag):
        return RankSteps(rank=index, count=48, step=0.035, data=0.001, compute=compute,
                         communication=communication, optimizer=0.002, other=0.0014, arrival_lag=lag, samples=1)

    chance = judge({0: rank(0, 0.0084, 0.021, 0.0053), 1: rank(1, 0.0067, 0.024, 0.0)})
    assert chance.straggler is None and chance.cause == "communication", chance
    slow = judge({0: rank(0, 0.0114, 0.021, 0.0053), 1: rank(1, 0.0067, 0.024, 0.0)})  # 4.7 ms more compute
    assert slow.straggler == 0 and slow.cause == "compute", slow
