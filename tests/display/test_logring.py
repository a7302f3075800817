from nblaunch.display.logring import MAX_LINE_CHARS, LogLine, LogRing


def texts(ring: LogRing) -> list[str]:
    return [line.text for line in ring.view()]


def test_keeps_the_last_lines_and_counts_all():
    ring = LogRing(capacity=3)
    for i in range(10):
        ring.add(LogLine(0, "stdout", f"line {i}"))
    assert texts(ring) == ["line 7", "line 8", "line 9"]
    assert (ring.total, ring.dropped) == (10, 7)


def test_a_transient_line_is_replaced_by_the_same_ranks_next_line():
    ring = LogRing(capacity=10)
    ring.add(LogLine(0, "stderr", " 10%|#"), transient=True)
    ring.add(LogLine(1, "stdout", "rank 1 says hi"))
    ring.add(LogLine(0, "stderr", " 20%|##"), transient=True)
    assert texts(ring) == ["rank 1 says hi", " 20%|##"]  # the line being redrawn stays last
    ring.add(LogLine(0, "stdout", "epoch done"))
    assert texts(ring) == ["rank 1 says hi", "epoch done"]
    assert ring.total == 2  # redraws are not lines


def test_a_huge_line_is_cut():
    ring = LogRing(capacity=2)
    ring.add(LogLine(0, "stdout", "x" * 10_000_000))
    (line,) = ring.view()
    assert len(line.text) < MAX_LINE_CHARS + 20 and line.text.endswith("[line cut]")


def test_extend_keeps_the_same_tail_and_count_as_adding_one_by_one():
    from nblaunch.display.logring import LogLine, LogRing

    one_by_one, batched = LogRing(capacity=5), LogRing(capacity=5)
    batches = [[f"a{i}" for i in range(3)], [f"b{i}" for i in range(12)], ["c" * 3000]]
    one_by_one.add(LogLine(1, "stdout", "redrawn"), transient=True)
    batched.add(LogLine(1, "stdout", "redrawn"), transient=True)
    for batch in batches:
        for text in batch:
            one_by_one.add(LogLine(1, "stdout", text))
        batched.extend(1, "stdout", batch)
    assert batched.view() == one_by_one.view()
    assert (batched.total, batched.dropped) == (one_by_one.total, one_by_one.dropped) == (16, 11)
