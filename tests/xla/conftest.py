"""The XLA lane: these tests need torch_xla (torch 2.9.0 + torch-xla 2.9.0, PJRT_DEVICE=CPU).

.ci/run builds that environment (.venv-xla) and runs this folder there; in the main lane,
where torch_xla is not installed, they are skipped with that reason.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before torch_xla is imported anywhere

if importlib.util.find_spec("torch_xla") is None:
    pytest.skip("the XLA lane (.venv-xla, run by .ci/run) runs these: torch_xla is not installed here",
                allow_module_level=True)
