"""Checkpoints: ``save_state`` / ``load_state`` (``files``) of a :class:`~.record.Prepared`
record, the plain list of what an Accelerator prepared (``record``), and ``host_saver``
(``torch.save`` that also works on XLA).

Imports ``runtime``, ``model`` (state dicts of sharded and wrapped models) and, for types only,
``step`` and ``data``; never the Accelerator.
"""
