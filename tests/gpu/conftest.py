"""The GPU tests' guard: the test process itself never initialises CUDA.

Every launch these tests make from the test process forks its ranks (nblaunch picks fork where
CUDA is untouched); if a test initialised CUDA here, every later launch would be a different
test (spawn) or would break. This fixture says which test did it.
"""

from __future__ import annotations

import pytest

from gpu_common import SKIP_REASON, cuda_state_here

# Before any GPU test: what collection (tests/conftest.py, plugins, imports) left.
AT_COLLECTION = cuda_state_here()


@pytest.fixture(autouse=True)
def cuda_untouched_in_the_test_process():
    if SKIP_REASON is None:
        assert not any(AT_COLLECTION.values()), (
            f"CUDA was initialised in the test process before any GPU test ran: {AT_COLLECTION}")
    yield
    if SKIP_REASON is None:
        state = cuda_state_here()
        assert not any(state.values()), f"this test initialised CUDA in the test process: {state}"
