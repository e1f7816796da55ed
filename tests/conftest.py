"""pytest hooks. The tests' shared helpers are in testing.py."""

import os

import pytest
import torch

# Triton's kernels run under its interpreter where no GPU is visible. Read when a kernel module
# is imported (each is imported lazily, on its first call), so it is set before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The most tests that may run Triton kernels under the interpreter (marked `triton`, not `cuda`),
# about three quarters of the suite's time on two cores: test_triton.py's
# test_interpreted_tests_stay_within_the_budget fails past it. A new kernel's launch
# configurations are tested against the C++ kernel on ragged shapes, and its op's semantics once
# on a slice; raise the budget only for what no existing test covers.
INTERPRETER_TEST_BUDGET = 897

# Modules whose tests start processes of their own (gloo ranks, torchrun, fresh venvs): under
# pytest-xdist (make test: `-n auto --dist loadgroup`) they share one worker, so that one of them
# runs at a time beside the other workers' tests and no rank waits on a starved peer.
OWN_PROCESSES = {"test_distributed", "test_pair_losses_distributed", "test_ddp", "test_example", "test_packaging"}


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist's, which reads the groups)
def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip themselves where no CUDA device is visible; tests that start
    processes join one xdist group."""
    for item in items:
        if item.module.__name__ in OWN_PROCESSES:
            item.add_marker(pytest.mark.xdist_group("own_processes"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def interpreted(item) -> bool:
    """Whether a test runs Triton kernels under the interpreter (where no GPU is visible)."""
    return item.get_closest_marker("triton") is not None and item.get_closest_marker("cuda") is None


@pytest.fixture(autouse=True)
def _triton_kernels(request):
    """A test marked `triton(op)` runs with op's Triton kernels in the slot of its `device`
    parameter (triton_testing.installed); one marked `triton(op, dispatch=False)` calls the
    Triton wrappers itself and compares them with the ops, whose slots keep the C++ kernels."""
    marker = request.node.get_closest_marker("triton")
    if marker is None:
        yield
        return
    import triton_testing

    if triton_testing.INTERPRETING:
        triton_testing.poison_masked_loads()
        triton_testing.quick_helper_calls()
    if not marker.kwargs.get("dispatch", True):
        yield
        return
    device = request.node.callspec.params.get("device", "cpu")
    with triton_testing.installed(marker.args[0], device):
        yield
