"""Launches that outlive the kernel that started them: ``notebook_launcher(..., detach=True)``,
``launches()`` and ``attach()``. See docs/architecture.md, "Detached launches"."""
