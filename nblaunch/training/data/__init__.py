"""Prepared DataLoaders: this rank's batches, on its device, resumable mid-epoch.

``loaders`` turns a user's DataLoader into a prepared one (Accelerate's ``prepare_data_loader``):
every rank reads its shard (``sharding``, with the shuffle order of ``shuffle`` and the batching
read by ``batching``) or rank 0 reads and sends each rank its part (``dispatch``). ``prepared``
is the loader itself (positions, progress, ``skip_first_batches``); ``uneven`` is
``join_uneven_inputs``.

Imports ``runtime``, ``options`` and ``step`` (the gradient state a loader reports to) only.
"""
