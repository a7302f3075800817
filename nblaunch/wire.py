"""Framing for the pipes between the launcher and its workers.

A frame is one byte of kind, eight bytes of little-endian length, then the body. Bodies are
pickles; the framing itself knows nothing about them. Both sides use the same few functions, so
the format lives in one place.
"""

from __future__ import annotations

import os
import socket
import struct

HEADER = struct.Struct("<cQ")

# Worker -> launcher
RESULT = b"R"  # pickled return value of the function
ERROR = b"E"  # a pickled RankFailure (nblaunch.contract.failure), twice: at once, then with the traceback
METRICS = b"M"  # pickled (values, step)
PROGRESS = b"P"  # pickled (bar_id, n, total, desc, closed, auto)
STACKS = b"S"  # utf-8 text: every thread's stack
CLEANED = b"C"  # empty body: the process stopped everything it had started, and is leaving
CALL_RESULT = b"A"  # warm ranks: pickled (call_id, return value of the call)
DEVICE = b"G"  # pickled (device, mixed precision) of the rank's Accelerator, when it is made
IMPORTED = b"O"  # pickled list: the installed modules the rank imported (nblaunch.machine.installed), at its end
CALL_FAILED = b"f"  # warm ranks: pickled (call_id, RankFailure): the call raised; the rank serves on
STEPS = b"s"  # pickled (call_id, step boundaries passed in the call or launch), asked by INTERRUPT
SAVING = b"v"  # a launch stopping at the agreed step: pickled (steps, checkpoint folder), before it writes
STOPPED = b"w"  # pickled (steps, checkpoint folder): saved; the rank leaves without a result
RELEASED = b"r"  # warm ranks: pickled str, "" or why not: the rank released its group (RELEASE)
MOVED = b"m"  # empty body: the rank's main thread moved since the last one (nblaunch.worker.movement)
COMPILING = b"c"  # pickled (compiling, seconds): a torch.compile began (False, 0) or ended after seconds
STEP_TIMES = b"t"  # pickled (StepRecords, note): steps split (nblaunch.worker.step_clock); note: "" or why none
COLLECTIVES = b"k"  # pickled {kind: (entered, left)}: the collectives counted, sent just before a STACKS answer
# Launcher -> worker
SPAWN_SETTINGS = b"W"  # spawn only: pickled (WorkerSettings, out-of-band buffers), before PAYLOAD
PAYLOAD = b"F"  # spawn only: cloudpickled (function, args)
DUMP_STACKS = b"D"  # empty body: please answer with a STACKS frame
CALL = b"L"  # warm ranks: cloudpickled (call_id, function, args) to run next
CLOSE = b"Q"  # warm ranks: empty body: no more calls, leave
SHARED = b"H"  # warm ranks: pickled (fd numbers, out-of-band buffers) of the next frame's shared
#                memory; the descriptors themselves ride on this frame's header (SCM_RIGHTS)
INTERRUPT = b"i"  # warm ranks and launches: pickled ("ask",) | ("at", boundary) | ("now",) (nblaunch.worker.step_stop)
RELEASE = b"x"  # warm ranks: empty body: make the group's waiting collectives raise (a peer failed)

# Kernel <-> its launch server (launch/starting/server_process), on a socket of its own
SERVER_PRELOAD = b"T"  # kernel: pickled (request id, modules wanted, the kernel's environ): import them there
SERVER_START = b"N"  # kernel: pickled (request id, environ, cwd); a rank's four pipe ends ride on it
SERVER_READY = b"Y"  # server: pickled (what importing torch read, torch's file): torch is imported
SERVER_LOADING = b"Z"  # server: pickled top-level package it imports now
SERVER_PRELOADED = b"J"  # server: pickled (request id, {package: (verdict, seconds, read)}, files, written)
SERVER_STARTED = b"I"  # server: pickled (request id, pid)
SERVER_FAILED = b"V"  # server: pickled (request id, what went wrong): no rank was started
SERVER_EXITED = b"X"  # server: pickled (pid, exit code), once the rank is reaped

# In a spawn payload's pickle: the persistent id of a tensor storage put in shared memory,
# (SHARED_STORAGE, fd, size, dtype); fd is the launcher's number for it. See nblaunch.launch.processes.packing.
SHARED_STORAGE = "nblaunch.shared-storage"


def encode(kind: bytes, body: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(body)) + body


def write_frame(fd: int, kind: bytes, body: bytes = b"") -> None:
    """Write one whole frame to a blocking file descriptor."""
    write_all(fd, HEADER.pack(kind, len(body)))
    if body:
        write_all(fd, body)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a blocking file descriptor."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


# The kernel takes at most 253 descriptors per message (SCM_MAX_FD); a frame header's 9 bytes
# each carry up to this many, so one frame can bring 2250.
_FDS_PER_MESSAGE = 250


def write_frame_with_fds(fd: int, kind: bytes, body: bytes, fds: list[int]) -> None:
    """Write one frame to the Unix socket ``fd``, its header carrying ``fds`` (duplicated into
    the reader, which gets them from ``recv_fds``; the caller may close its own at once)."""
    groups = [fds[i : i + _FDS_PER_MESSAGE] for i in range(0, len(fds), _FDS_PER_MESSAGE)]
    if len(groups) > HEADER.size:
        raise ValueError(f"at most {HEADER.size * _FDS_PER_MESSAGE} descriptors fit one frame, got {len(fds)}")
    head = HEADER.pack(kind, len(body))
    sock = socket.socket(fileno=fd)
    try:
        for i, group in enumerate(groups):  # one header byte per message, each with its group
            socket.send_fds(sock, [head[i : i + 1]], group)
    finally:
        sock.detach()  # the descriptor stays open: it is the caller's
    write_all(fd, head[len(groups) :])
    if body:
        write_all(fd, body)


class FrameReader:
    """Turns chunks read from a pipe into whole frames, however the chunks were cut."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._need: int | None = None  # body length of the frame being read, once its header is in
        self._kind = b""

    def feed(self, chunk: bytes) -> list[tuple[bytes, bytes]]:
        self._buffer += chunk
        frames = []
        while True:
            if self._need is None:
                if len(self._buffer) < HEADER.size:
                    break
                self._kind, self._need = HEADER.unpack_from(self._buffer)
                del self._buffer[: HEADER.size]
            if len(self._buffer) < self._need:
                break
            body = bytes(self._buffer[: self._need])
            del self._buffer[: self._need]
            frames.append((self._kind, body))
            self._need = None
        return frames

    @property
    def mid_frame(self) -> bool:
        """True while a frame has started but not all of it has arrived."""
        return self._need is not None or bool(self._buffer)
