"""A warm rank's side of a pool: its process group (formed, released, re-formed: ``group``; a
launch's batch search lends it too), and the collectives a call on some ranks refuses
(``subset_guard``). ``nblaunch.worker.calls`` serves the calls that use them."""
