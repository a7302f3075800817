"""The launch server's processes: where ranks come from when the kernel cannot fork them.

``base`` is the process the kernel starts (torch imported, CUDA never touched); ``generation`` a
process the base forks that imports, ahead of the ranks, what they will import (``loading``
judges each package); ``serving`` is the loop both run to fork ranks on request; a rank may be
forked ahead of its launch and wait on ``standby_rank`` with its GPU ready.
"""
