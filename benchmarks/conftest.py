import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "headline: the headline case of an op (make bench QUICK=1)")
    config.addinivalue_line("markers", "cuda: a GPU case, skipped without a CUDA device")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
