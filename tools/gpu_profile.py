"""Where each GPU headline case spends its time: a few calls of the op under torch.profiler,
its kernels by device time, and one line per case that says whether the device or the host
bounds it.

    python tools/gpu_profile.py [case ...]        (tools/gpu_check.sh runs it as STEPS=profile)

A call whose wall time is well above its kernels' device time waits on the host (ATen calls
and launches between kernels), and fusing launches is the fix; one whose kernels fill the
wall time is bound by them, and the kernel table says which. Cases are the GPU benchmarks'
headline shapes (benchmarks/bench_*.py). Runs on the CPU too (host time only), which is how
it is checked without a GPU.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from torchkit import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DEVICE == "cpu"  # on the CPU: the same code on small shapes, to check the script


def _grad(fn, *inputs):
    """A forward+backward callable: fn on the inputs, then backward of the output's sum."""

    def run():
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
        for x in inputs:
            x.grad = None

    return run


def _randn(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(grad)


def cases():
    s = 8 if SMALL else 1
    p = 8192 // s
    x, y = _randn(p, 128, grad=True), _randn(p, 128, grad=True)
    feats = _randn(32 // s, 512 // s, 28, 28, grad=True)
    feats_bf16 = _randn(32 // s, 512 // s, 28, 28, dtype=torch.bfloat16, grad=True)
    cov = _randn(32 // s, 256 // s, 28, 28, grad=True)
    logits = _randn(16384 // s, 32768 // s, dtype=torch.bfloat16, grad=True)
    target = torch.randint(0, 32768 // s, (16384 // s,), device=DEVICE)
    emb = _randn(20000 // s, 128)
    queries, gallery = _randn(1000 // s, 512), _randn(100000 // s, 512)
    images = _randn(256 // s, 3, 448, 448)
    emb_loss, emb_proxy = _randn(8192 // s, 128, grad=True), _randn(8192 // s, 512 // s, grad=True)
    labels = torch.arange(8192 // s, device=DEVICE) // 8
    proxies = _randn(11318 // s, 512 // s, grad=True)
    return {
        "cdist-forward": lambda: ops.cdist(x.detach(), y.detach()),
        "cdist-forward+backward": _grad(ops.cdist, x, y),
        "knn-leave-one-out": lambda: ops.knn(emb, k=8),
        "knn-query-gallery": lambda: ops.knn(queries, gallery, k=100),
        "bilinear_pool-forward+backward": _grad(ops.bilinear_pool, feats),
        "bilinear_pool-bf16-forward": lambda: ops.bilinear_pool(feats_bf16.detach()),
        "covariance_pool-forward+backward": _grad(ops.covariance_pool, cov),
        "label_smoothing_cross_entropy-bf16-forward+backward": _grad(
            lambda z: ops.label_smoothing_cross_entropy(z, target, label_smoothing=0.1), logits
        ),
        "region_confusion-forward": lambda: ops.region_confusion(images, 7, 2),
        # The pair losses on CUDA: their staged Triton kernels (_pair_losses_on_triton).
        "supcon_loss-forward+backward": _grad(lambda e: ops.supcon_loss(e, labels), emb_loss),
        "contrastive_loss-forward+backward": _grad(lambda e: ops.contrastive_loss(e, labels), emb_loss),
        "triplet_margin_loss-all-forward+backward": _grad(
            lambda e: ops.triplet_margin_loss(e, labels, mining="all"), emb_loss
        ),
        "multi_similarity_loss-forward+backward": _grad(lambda e: ops.multi_similarity_loss(e, labels), emb_loss),
        "proxy_anchor_loss-forward+backward": _grad(
            lambda e, p: ops.proxy_anchor_loss(e, labels, p), emb_proxy, proxies
        ),
    }


def _pair_losses_on_triton():
    """The pair losses' only CUDA kernels are their staged Triton ones: registered for the
    profile, as TORCHKIT_CUDA_KERNELS=triton would, for these ops alone (the other cases keep
    the CUDA C++ kernels). Returns the registration, which lasts as long as it is held."""
    from torchkit import triton as triton_path

    library = torch.library.Library("torchkit", "IMPL")
    for name, function in triton_path.TRITON_KERNELS["pair_losses"].items():
        library.impl(name.split("::")[1], triton_path._kernel("pair_losses", function), "CUDA")
    return library


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def profile_case(name, fn, calls=5):
    for _ in range(3):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    wall_ms = (time.perf_counter() - start) / calls * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        _sync()
    events = prof.key_averages()
    if DEVICE != "cuda":
        return f"{name}: wall {wall_ms:.3f} ms/call (host only)", events.table(
            sort_by="self_cpu_time_total", row_limit=15
        )
    # Kernels, copies and fills: the events with device time and no host time of their own
    # (an ATen op's event also carries its kernels' device time: counting it would count twice).
    device = [e for e in events if e.self_cpu_time_total == 0 and e.self_device_time_total > 0]
    device_ms = sum(e.self_device_time_total for e in device) / calls / 1e3
    launches = sum(e.count for e in device) / calls
    busy = device_ms / wall_ms
    verdict = "device-bound" if busy >= 0.8 else "host-bound (launches, ATen calls)" if busy < 0.6 else "mixed"
    summary = (
        f"{name}: wall {wall_ms:.3f} ms/call, kernels {device_ms:.3f} ms/call "
        f"({launches:.0f} launches), device busy {busy:.0%}: {verdict}"
    )
    return summary, events.table(sort_by="self_device_time_total", row_limit=15)


def main(names):
    registration = _pair_losses_on_triton() if DEVICE == "cuda" else None  # noqa: F841 (held)
    all_cases = cases()
    unknown = [n for n in names if n not in all_cases]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; cases: {', '.join(all_cases)}")
    summaries = []
    for name in names or all_cases:
        summary, table = profile_case(name, all_cases[name])
        print(f"## {name}\n{table}\n{summary}\n", flush=True)
        summaries.append(summary)
    print("\n".join(summaries))


if __name__ == "__main__":
    main(sys.argv[1:])
