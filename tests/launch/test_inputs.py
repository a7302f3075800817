"""Bad input is refused before any process starts, with a message that says what to do."""

from __future__ import annotations

import inspect
import os
import re
import socket

import psutil
import pytest

from nblaunch import LaunchConfigError, notebook_launcher


def noop():
    return 0


def children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_processes": 0}, "num_processes must be a positive int"),
        ({"num_processes": -2}, "num_processes must be a positive int"),
        ({"num_processes": 2.0}, "num_processes must be a positive int"),
        ({"num_processes": "2"}, "num_processes must be a positive int"),
        ({"num_processes": True}, "num_processes must be a positive int"),
        ({"num_processes": 2, "mixed_precision": "fp4"}, "mixed_precision must be one of no, fp16, bf16, fp8"),
        ({"num_processes": 2, "node_rank": 1, "num_nodes": 1}, "node_rank must be an int in 0..num_nodes-1"),
        ({"num_processes": 2, "num_nodes": 0}, "num_nodes must be a positive int"),
        ({"num_processes": 2, "use_port": "http"}, "use_port must be a port number"),
        ({"num_processes": 2, "use_port": 70000}, "use_port must be a port number"),
        ({"num_processes": 2, "start_method": "forkserver"}, "start_method must be None"),
        ({"num_processes": 2, "timeout": -1}, "timeout must be a positive, finite number"),
        ({"num_processes": 2, "timeout": float("inf")}, "timeout must be a positive, finite number"),
        ({"num_processes": 2, "timeout": float("nan")}, "timeout must be a positive, finite number"),
        ({"num_processes": 2, "use_port": 2.5}, "use_port must be a port number"),
        ({"num_processes": 2, "display": object()}, "or an object with on_event"),
        ({"num_processes": 2, "display": "fancy"}, "display must be one of"),
        ({"num_processes": 2, "args": [1]}, "args must be a tuple"),
        ({"num_processes": 2, "cpu": "yes"}, "cpu must be True or False"),
        ({"num_processes": 2, "num_nodes": 2, "node_rank": 1}, None),  # checked below: port needed
    ],
)
def test_bad_input_is_refused_before_anything_starts(kwargs, message):
    kwargs = dict(kwargs)
    args = kwargs.pop("args", ())
    if message is None:
        message = "every node must agree on the port"
        kwargs["node_rank"] = 0
    before = children()
    with pytest.raises(LaunchConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        notebook_launcher(noop, args, **kwargs)
    assert children() == before


def test_a_function_that_is_not_callable_is_refused():
    with pytest.raises(LaunchConfigError, match="function must be callable"):
        notebook_launcher("train", num_processes=2)


def test_a_busy_pinned_port_says_so_and_suggests_a_free_one():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchConfigError, match=rf"use_port={port} is already in use.*use_port=None"):
            notebook_launcher(noop, num_processes=2, use_port=port)


def test_an_unpicklable_closure_variable_is_named():
    db = socket.socket()

    def train():
        return db.fileno()

    try:
        with pytest.raises(LaunchConfigError) as info:
            notebook_launcher(train, num_processes=2)
    finally:
        db.close()
    text = str(info.value)
    assert "closure variable `db` of `train` holds a socket.socket" in text
    assert "inside the function" in text


def test_an_unpicklable_argument_is_named():
    import threading

    with pytest.raises(LaunchConfigError, match=r"key 'lock' of argument 1 of the launch \(args\[1\]\) holds a _thread.lock"):
        notebook_launcher(lambda *args: 0, args=(1, {"lock": threading.Lock()}), num_processes=2)


async def an_async_function():
    return 1


def a_generator_function():
    yield 1


def takes_two(a, b):
    return a + b


@pytest.mark.parametrize(
    "function, args, message",
    [
        (an_async_function, (), "is an async function"),
        (a_generator_function, (), "is a generator function"),
        (takes_two, (1,), r"takes_two\(a, b\) cannot be called with args=\(1,\): missing a required argument: 'b'"),
        (takes_two, (1, 2, 3), "too many positional arguments"),
    ],
)
def test_a_function_the_ranks_could_not_call_is_refused_before_anything_starts(function, args, message):
    before = children()
    with pytest.raises(LaunchConfigError, match=message):
        notebook_launcher(function, args, num_processes=2)
    assert children() == before


def sleeps():
    import time

    time.sleep(600)


def test_a_timeout_holds_for_one_process_too():
    from nblaunch import LaunchTimeoutError

    with pytest.raises(LaunchTimeoutError) as info:
        notebook_launcher(sleeps, num_processes=1, timeout=1, display="none")
    assert "time.sleep(600)" in info.value.stacks[0]


def test_more_ranks_than_open_files_allow_is_refused_with_what_to_do():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        before = children()
        with pytest.raises(LaunchConfigError, match=r"num_processes=300 needs about \d+ open files.*limit is 256.*setrlimit"):
            notebook_launcher(noop, num_processes=300, display="none")
        assert children() == before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def where_we_meet():
    return os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]


def test_accelerates_parameters_come_in_its_order_and_mean_the_same():
    accelerate = pytest.importorskip("accelerate")
    theirs = list(inspect.signature(accelerate.notebook_launcher).parameters.values())
    ours = list(inspect.signature(notebook_launcher).parameters.values())
    assert [p.name for p in ours[:len(theirs)]] == [p.name for p in theirs]  # positional calls port as they are
    for mine, their in zip(ours, theirs):
        assert mine.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
        # use_port None: a free port, where Accelerate's "29500" collides; num_nodes None: the cluster
        # decides, 1 on this machine as Accelerate's 1, every node of a Slurm job with cluster="slurm".
        if mine.name not in ("use_port", "num_nodes"):
            assert mine.default == their.default, mine.name
    port = free_port()
    # Accelerate's positional order, up to log_line_prefix_template; rdzv_endpoint names the meeting point.
    assert notebook_launcher(where_we_meet, (), 2, "no", None, "127.0.0.1", 0, 1, "c10d", f"127.0.0.1:{port}",
                             None, "job-7", 0, 0.1, None, display="none") == [("127.0.0.1", str(port))] * 2


@pytest.mark.parametrize("kwargs, message", [
    ({"rdzv_endpoint": "127.0.0.1:29511", "use_port": 29512}, "name different meeting points: give one of them"),
    ({"rdzv_endpoint": "10.0.0.1:29511", "master_addr": "10.0.0.2"}, "name different meeting points"),
    ({"rdzv_endpoint": ":29511"}, "rdzv_endpoint must be 'host:port' or 'host'"),
    ({"rdzv_conf": {"timeout": 900}}, "configures torchelastic's dynamic rendezvous, which nblaunch does not use"),
    ({"log_line_prefix_template": "${rank}: "}, "nblaunch tags every line with its rank itself"),
    ({"rdzv_id": 7}, "rdzv_id must be a string"),
])
def test_elastic_arguments_that_cannot_apply_are_refused_with_what_to_do(kwargs, message):
    before = children()
    with pytest.raises(LaunchConfigError, match=re.escape(message)):
        notebook_launcher(noop, num_processes=2, display="none", **kwargs)
    assert children() == before
