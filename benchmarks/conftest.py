import os
import subprocess
import sys

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: a GPU case, skipped without a CUDA device")


def pytest_collection_modifyitems(config, items):
    config.torchkit_items = list(items)
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


def pytest_benchmark_update_machine_info(config, machine_info):
    """The report names the GPU and torch that produced the numbers."""
    machine_info["torch"] = torch.__version__
    if torch.cuda.is_available():
        machine_info["gpu"] = torch.cuda.get_device_name()


@pytest.fixture(scope="session", autouse=True)
def contention():
    """TORCHKIT_BENCH_CONTENDED=1 (make bench CONTENDED=1): one CPU-bound process runs beside
    every case, as a DataLoader worker decoding images runs beside training. Thread pools
    that spin, or that wait at a barrier for a thread the OS has descheduled, show here."""
    if os.environ.get("TORCHKIT_BENCH_CONTENDED") != "1":
        yield
        return
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["machine_info"]["contended"] = os.environ.get("TORCHKIT_BENCH_CONTENDED") == "1"
    # The report's headline table takes the cases marked `headline`: the JSON records which.
    headline = {item.nodeid for item in config.torchkit_items if "headline" in item.keywords}
    for entry in output_json["benchmarks"]:
        entry["extra_info"]["headline"] = entry["fullname"] in headline
