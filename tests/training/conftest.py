import pytest

from nblaunch.training.runtime.state import reset_process_state


@pytest.fixture(autouse=True)
def _fresh_process_state():
    reset_process_state()
    yield
    reset_process_state()


def run_launch(function, *args, num_processes=2, display="none"):
    """Run ``function(*args)`` in real worker processes; returns each rank's result."""
    from nblaunch.api import notebook_launcher

    return notebook_launcher(function, args=args, num_processes=num_processes, display=display)


@pytest.fixture(scope="session")
def launch():
    return run_launch
