"""pytest hooks. The tests' shared helpers are in testing.py."""

import os

import pytest
import torch

# Triton's kernels run under its interpreter where no GPU is visible. Read when a kernel module
# is imported (each is imported lazily, on its first call), so it is set before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip themselves where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


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
    if not marker.kwargs.get("dispatch", True):
        yield
        return
    device = request.node.callspec.params.get("device", "cpu")
    with triton_testing.installed(marker.args[0], device):
        yield
