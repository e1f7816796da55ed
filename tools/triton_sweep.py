"""Time every launch configuration of each Triton kernel per shape class on the local GPU and
record the fastest (make gpu-check's "sweep" step).

    python tools/triton_sweep.py --out benchmarks/results/h100/triton-configs.json

The kernels' default configuration is the first of their lists (torchkit/triton/<op>.py); a
GPU session reads this file to reorder them. Each configuration is checked against the op on
the CPU before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# op -> shape classes: (name, first input's shape, second's or None, dtype)
SHAPES = {
    "bilinear_pool": [
        ("N=32 D=512 28x28 fp32", (32, 512, 28, 28), None, torch.float32),
        ("N=32 D=512 28x28 bf16", (32, 512, 28, 28), None, torch.bfloat16),
        ("two-stream N=32 D=E=256 28x28 bf16", (32, 256, 28, 28), (32, 256, 28, 28), torch.bfloat16),
    ],
    "cdist": [
        ("batch P=R=256 M=128 fp32", (256, 128), (256, 128), torch.float32),
        ("P=R=8192 M=128 fp32", (8192, 128), (8192, 128), torch.float32),
        ("P=R=8192 M=128 bf16", (8192, 128), (8192, 128), torch.bfloat16),
        ("self P=4096 M=512 fp32", (4096, 512), None, torch.float32),
    ],
    # supcon_loss, ntxent_loss and multi_similarity_loss: (N, D) embeddings (refs: None), 100
    # classes; proxy_anchor_loss with up to 1,000 of the rows as proxies.
    "pair_losses": [
        ("N=1024 D=512 fp32", (1024, 512), None, torch.float32),
        ("N=8192 D=128 fp32", (8192, 128), None, torch.float32),
        ("N=8192 D=128 bf16", (8192, 128), None, torch.bfloat16),
        ("N=4096 refs 16384 D=128 fp32", (4096, 128), (16384, 128), torch.float32),
    ],
}


def milliseconds(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def sweep_cdist(results: dict) -> None:
    from torchkit.triton import cdist as kernels

    for name, s1, s2, dtype in SHAPES["cdist"]:
        g = torch.Generator("cuda").manual_seed(0)
        a = torch.randn(s1, generator=g, device="cuda").to(dtype)
        b = None if s2 is None else torch.randn(s2, generator=g, device="cuda").to(dtype)
        expected = torch.ops.torchkit.cdist(a[:512].cpu(), None if b is None else b[:512].cpu(), False)
        rows = []
        for i, config in enumerate(kernels.FORWARD_CONFIGS):
            got = kernels.forward(a[:512], None if b is None else b[:512], False, config=config).cpu()
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1e-2)
            rows.append(
                (
                    "forward",
                    i,
                    repr(config),
                    milliseconds(lambda c=config, a=a, b=b: kernels.forward(a, b, False, config=c)),
                )
            )
        d = kernels.forward(a, b, False)
        grad = torch.randn_like(d)
        for i, config in enumerate(kernels.GRAD_CONFIGS):
            ms = milliseconds(
                lambda a=a, b=b, d=d, grad=grad, c=config: kernels.backward(
                    grad, a, b, d, False, [True, True], config=c
                )
            )
            rows.append(("grad", i, repr(config), ms))
        report("cdist", name, rows, results)


def sweep_bilinear_pool(results: dict) -> None:
    from torchkit.triton import bilinear_pool as kernels

    for name, s1, s2, dtype in SHAPES["bilinear_pool"]:
        g = torch.Generator("cuda").manual_seed(0)
        x = torch.randn(s1, generator=g, device="cuda").relu_().to(dtype)
        y = None if s2 is None else torch.randn(s2, generator=g, device="cuda").relu_().to(dtype)
        expected, _ = torch.ops.torchkit.bilinear_pool(x[:2].cpu(), None if y is None else y[:2].cpu(), 1e-5, 1e-12)
        rows = []
        for i, config in enumerate(kernels.FORWARD_CONFIGS):
            got, _ = kernels.forward(x[:2], None if y is None else y[:2], 1e-5, 1e-12, config=config)
            torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=2e-2, atol=1e-3)
            ms = milliseconds(lambda c=config, x=x, y=y: kernels.forward(x, y, 1e-5, 1e-12, config=c))
            rows.append(("forward", i, repr(config), ms))
        out, norm = kernels.forward(x, y, 1e-5, 1e-12)
        args = (torch.randn_like(out), x, y, out, norm, 1e-5, 1e-12, [True, y is not None])
        for i, config in enumerate(kernels.GRAD_CONFIGS):
            ms = milliseconds(lambda c=config, args=args: kernels.backward(*args, config=c))
            rows.append(("backward", i, repr(config), ms))
        report("bilinear_pool", name, rows, results)


def sweep_pair_losses(results: dict) -> None:
    from torchkit.triton import pair_losses as kernels

    for name, s1, s2, dtype in SHAPES["pair_losses"]:
        g = torch.Generator("cuda").manual_seed(0)
        e = torch.randn(s1, generator=g, device="cuda").to(dtype)
        labels = torch.randint(100, (s1[0],), generator=g, device="cuda")
        r = None if s2 is None else torch.randn(s2, generator=g, device="cuda").to(dtype)
        rl = None if s2 is None else torch.randint(100, (s2[0],), generator=g, device="cuda")
        rows = []
        for loss in ("supcon", "ntxent"):
            forward, backward = getattr(kernels, f"{loss}_forward"), getattr(kernels, f"{loss}_backward")
            small = (e[:300], labels[:300], None if r is None else r[:200], None if r is None else rl[:200], 0.1)
            on_cpu = [t.cpu() if torch.is_tensor(t) else t for t in small]
            expected, _ = getattr(torch.ops.torchkit, f"{loss}_loss")(*on_cpu)
            for i, config in enumerate(kernels.lse.ROWS_CONFIGS):
                got, _ = forward(*small, config=config)
                torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=1e-4, atol=1e-5)
                ms = milliseconds(lambda c=config, f=forward, args=(e, labels, r, rl, 0.1): f(*args, config=c))
                rows.append((f"{loss}.rows", i, repr(config), ms))
            value, stats = forward(e, labels, r, rl, 0.1)
            args = (torch.ones_like(value), e, labels, r, rl, stats, 0.1, [True, r is not None])
            for i, config in enumerate(kernels.lse.GRAD_CONFIGS):
                ms = milliseconds(lambda c=config, b=backward, args=args: b(*args, config=c))
                rows.append((f"{loss}.grad", i, repr(config), ms))
        ms = (2.0, 50.0, 0.5, 0.1)
        for i, config in enumerate(kernels.ms.ROWS_CONFIGS):
            args = (e, labels, r, rl, *ms)
            t = milliseconds(lambda c=config, args=args: kernels.multi_similarity_forward(*args, config=c))
            rows.append(("multi_similarity.rows", i, repr(config), t))
        value, stats = kernels.multi_similarity_forward(e, labels, r, rl, *ms)
        args = (torch.ones_like(value), e, labels, r, rl, stats, *ms, [True, r is not None])
        for i, config in enumerate(kernels.ms.GRAD_CONFIGS):
            t = milliseconds(lambda c=config, args=args: kernels.multi_similarity_backward(*args, config=c))
            rows.append(("multi_similarity.grad", i, repr(config), t))
        margins = (0.0, 1.0, "euclidean")
        for i, config in enumerate(kernels.euclid.ROWS_CONFIGS):
            args = (e, labels, r, rl, *margins)
            t = milliseconds(lambda c=config, args=args: kernels.contrastive_forward(*args, config=c))
            rows.append(("contrastive.rows", i, repr(config), t))
        value, stats = kernels.contrastive_forward(e, labels, r, rl, *margins)
        args = (torch.ones_like(value), e, labels, r, rl, stats, *margins, [True, r is not None])
        for i, config in enumerate(kernels.euclid.GRAD_CONFIGS):
            t = milliseconds(lambda c=config, args=args: kernels.contrastive_backward(*args, config=c))
            rows.append(("contrastive.grad", i, repr(config), t))
        for i, config in enumerate(kernels.triplets.ROWS_CONFIGS):
            args = (e, labels, r, rl, 0.05, "batch_hard", "euclidean")
            t = milliseconds(lambda c=config, args=args: kernels.triplet_margin_forward(*args, config=c))
            rows.append(("triplet_batch_hard.rows", i, repr(config), t))
        value, stats = kernels.triplet_margin_forward(e, labels, r, rl, 0.05, "batch_hard", "euclidean")
        args = (torch.ones_like(value), e, labels, r, rl, stats, 0.05, "batch_hard", "euclidean", [True, r is not None])
        for i, config in enumerate(kernels.HARD_GRAD_CONFIGS):
            t = milliseconds(lambda c=config, args=args: kernels.triplet_margin_backward(*args, config=c))
            rows.append(("triplet_batch_hard.grad", i, repr(config), t))
        for mining in ("all", "semi_hard"):
            for i, config in enumerate(kernels.triplets.ALL_ROWS_CONFIGS):
                args = (e, labels, r, rl, 0.05, mining, "euclidean")
                t = milliseconds(lambda c=config, args=args: kernels.triplet_margin_forward(*args, config=c))
                rows.append((f"triplet_{mining}.rows", i, repr(config), t))
            value, stats = kernels.triplet_margin_forward(e, labels, r, rl, 0.05, mining, "euclidean")
            args = (torch.ones_like(value), e, labels, r, rl, stats, 0.05, mining, "euclidean", [True, r is not None])
            for i, config in enumerate(kernels.triplets.BAND_GRAD_CONFIGS):
                t = milliseconds(lambda c=config, args=args: kernels.triplet_margin_backward(*args, config=c))
                rows.append((f"triplet_{mining}.grad", i, repr(config), t))
        # proxy_anchor_loss: the refs (or the embeddings) as its proxies.
        proxies = (e if r is None else r)[:1000]
        classes = labels % proxies.shape[0]
        for i, config in enumerate(kernels.lse.ROWS_CONFIGS):
            args = (e, classes, proxies, 0.1, 32.0)
            ms = milliseconds(lambda c=config, args=args: kernels.proxy_anchor_forward(*args, config=c))
            rows.append(("proxy_anchor.rows", i, repr(config), ms))
        value, stats = kernels.proxy_anchor_forward(e, classes, proxies, 0.1, 32.0)
        args = (torch.ones_like(value), e, classes, proxies, stats, 0.1, 32.0, [True, True])
        for i, config in enumerate(kernels.lse.GRAD_CONFIGS):
            ms = milliseconds(lambda c=config, args=args: kernels.proxy_anchor_backward(*args, config=c))
            rows.append(("proxy_anchor.grad", i, repr(config), ms))
        report("pair_losses", name, rows, results)


def report(op: str, name: str, rows: list, results: dict) -> None:
    """Print each configuration's time and record the fastest per kernel."""
    best = {}
    for kernel, i, text, ms in rows:
        print(f"{op} {name:<28} {kernel:<10} {text:<70} {ms:8.3f} ms")
        if kernel not in best or ms < best[kernel]["ms"]:
            best[kernel] = {"index": i, "config": text, "ms": ms}
    results.setdefault(op, {})[name] = {
        "best": best,
        "all": [dict(zip(("kernel", "index", "config", "ms"), r, strict=True)) for r in rows],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("triton_sweep: no CUDA device", file=sys.stderr)
        return 2
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    sweep_cdist(results)
    sweep_bilinear_pool(results)
    sweep_pair_losses(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
