"""What ``prepare`` does to a model: placing it on the device (``placement``), mixed precision
(``precision``), wrapping it in DDP (``ddp``) or sharding it with FSDP2 (``fsdp``), and turning
its gradient synchronisation off and on (``gradient_sync``).

Imports ``runtime`` and ``options`` only.
"""
