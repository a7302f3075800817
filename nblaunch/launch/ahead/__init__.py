"""A warm start: a launch's ranks begin with what the work needs already loaded, and on a GPU
with CUDA ready (docs/architecture.md, "A warm start"): what earlier ranks imported (``ledger``),
imported here for forked ranks (``kernel_preload``), or by the launch server's generations for
its ranks, with ranks waiting on standby (``launch_server``, ``server_link``, ``standby``)."""
