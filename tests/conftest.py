"""pytest hooks. The tests' shared helpers are in testing.py."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip themselves where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
