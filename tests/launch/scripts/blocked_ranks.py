"""Launch 2 ranks that block (rank 0 in a C++ recv nobody answers, rank 1 asleep) and tell the
test their pids. What happens next is the test's business: an interrupt, or killing this process."""

import os
import sys
import time

import torch
import torch.distributed as dist

from nblaunch import notebook_launcher


def block_forever():
    dist.init_process_group("gloo")
    print(f"ready pid={os.getpid()}", flush=True)
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    else:
        time.sleep(600)


def quick():
    return int(os.environ["RANK"])


if __name__ == "__main__":
    try:
        notebook_launcher(block_forever, num_processes=2, display="text")
    except KeyboardInterrupt:
        print("launcher raised KeyboardInterrupt", flush=True)
        print("next launch:", notebook_launcher(quick, num_processes=2, display="none"), flush=True)
    sys.exit(0)
