"""A warm rank's side of a pool: its process group (formed, released, re-formed: ``group``), where
an interrupt stops a call (``cell_stop``), and the collectives a call on some ranks refuses
(``subset_guard``). ``nblaunch.worker.calls`` serves the calls that use them."""
