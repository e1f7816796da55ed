"""What every benchmark file uses: one timed case per (op, case, pass, implementation),
tagged so that benchmarks/report.py can line torchkit up against its peers."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import torch

# The impl name of the machine's own limit for a case (see run()).
ROOFLINE = "roofline"

# Each case is timed for about this long (at least MIN_ROUNDS rounds, at most MAX_ROUNDS);
# a round repeats a fast call until it lasts ROUND_SECONDS, so that sub-millisecond cases
# are not medians of a few noisy single calls. TORCHKIT_BENCH_SECONDS shortens a run where
# time is short (a lent GPU: its timings are steady enough for 0.3 s per case).
TARGET_SECONDS = float(os.environ.get("TORCHKIT_BENCH_SECONDS", "1.0"))
ROUND_SECONDS = 2e-3
MIN_ROUNDS, MAX_ROUNDS = 3, 100


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_extra_bytes(fn, device: torch.device) -> int | None:
    """Peak memory that one call of fn adds on top of what is allocated before it.

    CUDA: the caching allocator's peak. CPU: the growth of the process's peak resident set
    (VmHWM, reset through /proc/self/clear_refs) after malloc_trim has returned free heap
    memory to the OS; glibc maps blocks over 32 MiB afresh each time, so the large tensors
    that matter are counted exactly. None where neither is available.
    """
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        base = _rss_bytes("VmRSS")
        fn()
        return max(_rss_bytes("VmHWM") - base, 0)
    except OSError:
        return None


def run(benchmark, fn, *, op: str, case: str, pass_: str, impl: str, device, **extra) -> None:
    """Time fn (a closure over prepared inputs) as one pytest-benchmark entry.

    `impl` is "torchkit", a peer's name, or ROOFLINE: the machine's own primitive doing the
    work the op cannot avoid (a GEMM of the same shape, the same memory traffic through a
    copy), timed in the same run. The report divides each peer's median by torchkit's within
    the same (op, case, pass) group, and torchkit's by the roofline's. Extra keyword arguments
    land in extra_info: `max_rel_error` (cdist's accuracy column), and `flops` or `bytes`, the
    work of the case, from which the report gives TFLOP/s or GB/s.
    """
    device = torch.device(device)

    def call():
        fn()
        _sync(device)

    call()  # warm-up: first-call allocations, compilation, lazy initialisation
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-9)
    iterations = max(1, int(ROUND_SECONDS / once))
    rounds = int(min(MAX_ROUNDS, max(MIN_ROUNDS, TARGET_SECONDS / (once * iterations))))

    benchmark.group = f"{op} | {case} | {pass_}"
    benchmark.extra_info.update(
        op=op, case=case, pass_=pass_, impl=impl, device=str(device), peak_bytes=peak_extra_bytes(fn, device), **extra
    )
    benchmark.pedantic(call, rounds=rounds, iterations=iterations, warmup_rounds=0)
