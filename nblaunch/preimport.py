"""Importing heavy modules once in the launcher, so forked ranks inherit them.

Some imports write into ``os.environ`` (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR, torch_xla
sets XLA_FLAGS and more). Those variables are for the ranks, not the user's kernel: the kernel's
environment is put back and the changes are returned, for the launch to hand to its ranks.
"""

from __future__ import annotations

import functools
import importlib
import os


@functools.lru_cache(maxsize=None)
def import_for_ranks(module: str) -> dict[str, str]:
    """Import ``module`` here (once per kernel); return what the import wrote into os.environ.

    Example::

        extra_environ = import_for_ranks("torch._dynamo")  # {"TORCHINDUCTOR_CACHE_DIR": ...}
    """
    before = dict(os.environ)
    try:
        importlib.import_module(module)
    finally:
        after = dict(os.environ)
        changed = {name: value for name, value in after.items() if before.get(name) != value}
        # Only what the import touched is put back: other threads read os.environ meanwhile.
        for name in changed:
            if name in before:
                os.environ[name] = before[name]
            else:
                del os.environ[name]
        for name in before.keys() - after.keys():
            os.environ[name] = before[name]
    return changed
