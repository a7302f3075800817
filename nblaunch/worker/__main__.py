"""``python -m nblaunch.worker CONTROL_FD EVENT_FD PARENT_PID``: a spawned worker."""

import sys

from nblaunch.worker.bootstrap import main_spawned

main_spawned(sys.argv[1:])
