"""A few small CUDA calls of one op, forward and backward, for compute-sanitizer.

    compute-sanitizer --tool memcheck python tools/sanitize_cases.py cdist
    compute-sanitizer --tool memcheck python tools/sanitize_cases.py triton:cdist

(triton:<op>: the same calls with the op's Triton kernels serving CUDA tensors,
TORCHKIT_CUDA_KERNELS=triton.)

The test suite under a sanitizer takes too long (each launch is instrumented), so this runs
every kernel of the op once or twice, over the layouts and dtypes that pick different code:
rows and positions (cross-entropy), self and two-stream (bilinear), options and layouts
(covariance), batched and broadcast (cdist), contiguous and channels_last (region confusion),
with odd sizes for the tails.
Exits non-zero if a result disagrees with the op on the CPU.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and len(sys.argv) == 2 and sys.argv[1].startswith("triton:"):
    os.environ["TORCHKIT_CUDA_KERNELS"] = "triton"  # read when torchkit is imported

import torch

from torchkit import ops


def check(fn, *inputs, grad=True, **options):
    """fn(*inputs, **options) on CUDA copies of the tensors, forward and (with grad) backward,
    against the CPU. Gradients are taken for floating `inputs`, never for `options`."""

    def on(device):
        args = [x.detach().to(device).requires_grad_(grad and x.is_floating_point()) for x in inputs]
        return args, {k: v.to(device) if torch.is_tensor(v) else v for k, v in options.items()}

    (cpu, cpu_options), (gpu, gpu_options) = on("cpu"), on("cuda")
    a, b = fn(*cpu, **cpu_options), fn(*gpu, **gpu_options)
    if grad:
        g = torch.randn_like(a)
        ga = torch.autograd.grad(a, [x for x in cpu if x.requires_grad], g)
        gb = torch.autograd.grad(b, [x for x in gpu if x.requires_grad], g.cuda())
        for u, v in zip(ga, gb, strict=False):
            torch.testing.assert_close(v.cpu(), u, atol=1e-3, rtol=1e-3, equal_nan=True)
    # A reduced-precision output may round the other way: one ulp of it apart.
    tol = max(1e-3, 2 * torch.finfo(a.dtype).eps) if a.is_floating_point() else 1e-3
    torch.testing.assert_close(b.detach().cpu(), a.detach(), atol=1e-3, rtol=tol, equal_nan=True)


def cdist():
    for dtype in (torch.float32, torch.float64):
        check(ops.cdist, torch.randn(37, 19, dtype=dtype), torch.randn(41, 19, dtype=dtype))
        check(ops.cdist, torch.randn(2, 3, 65, 7, dtype=dtype), torch.randn(3, 33, 7, dtype=dtype))
        check(ops.cdist, 1000 + torch.randn(50, 9, dtype=dtype))
        check(ops.cdist, torch.randn(5, 3, dtype=dtype), torch.randn(6, 3, dtype=dtype), squared=True)
    check(ops.cdist, torch.randn(33, 8).half(), torch.randn(17, 8).half(), grad=False)
    check(ops.cdist, torch.randn(70, 40).bfloat16(), torch.randn(129, 40).bfloat16(), grad=False)


def bilinear_pool():
    for dtype in (torch.float32, torch.float64):
        check(ops.bilinear_pool, torch.randn(2, 33, 5, 7, dtype=dtype).relu())
        check(ops.bilinear_pool, torch.randn(2, 33, 5, 7, dtype=dtype), torch.randn(2, 17, 5, 7, dtype=dtype))
        x = torch.randn(2, 20, 4, 4, dtype=dtype).to(memory_format=torch.channels_last)
        check(ops.bilinear_pool, x)
    check(ops.bilinear_pool, torch.randn(2, 16, 3, 3).bfloat16(), grad=False)


def label_smoothing_cross_entropy():
    loss = ops.label_smoothing_cross_entropy
    for dtype in (torch.float32, torch.float64):
        for shape in ((13, 1030), (3, 6, 4, 5), (7,)):
            x = 3 * torch.randn(shape, dtype=dtype)
            pos = shape[:1] + shape[2:] if len(shape) > 1 else ()
            t = torch.randint(shape[1 if len(shape) > 1 else 0], pos)
            if t.numel() > 1:
                t.view(-1)[0] = -100
            w = torch.rand(shape[1 if len(shape) > 1 else 0], dtype=dtype) + 0.5
            for reduction in ("mean", "none"):
                check(loss, x, t, reduction=reduction, label_smoothing=0.1)
                check(loss, x, t, weight=w, reduction=reduction)
            p = torch.randn(shape, dtype=dtype).softmax(1 if len(shape) > 1 else 0)
            check(loss, x, p, label_smoothing=0.2)
        # Logits where the saved lse is coarse: the backward recomputes rows and positions.
        for shape in ((13, 1030), (3, 6, 4, 5)):
            x = 1e18 * (1 + torch.finfo(dtype).eps * torch.randint(-3, 4, shape).to(dtype))
            check(loss, x, torch.randint(shape[1], shape[:1] + shape[2:]), label_smoothing=0.1)
    check(loss, torch.randn(9, 100).bfloat16(), torch.randint(100, (9,)))


def region_confusion():
    for dtype in (torch.float32, torch.uint8, torch.float16, torch.int64):
        x = torch.randint(0, 200, (3, 3, 30, 31)).to(dtype)
        perm = torch.stack([torch.randperm(49) for _ in range(3)])
        check(ops.permute_blocks, x, perm, num_blocks=7, grad=dtype.is_floating_point)
        check(ops.permute_blocks, x.to(memory_format=torch.channels_last), perm, num_blocks=7, grad=False)
    x = torch.randn(2, 3, 28, 28, device="cuda", requires_grad=True)
    out, _ = ops.region_confusion(x, 7, 2)
    out.sum().backward()


def knn():
    def distances(query, gallery=None, k=1):
        return ops.knn(query, gallery, k)[0]

    for dtype in (torch.float32, torch.float64):
        check(distances, torch.randn(37, 19, dtype=dtype), torch.randn(8300, 19, dtype=dtype), k=7)  # two chunks
        check(distances, torch.randn(2, 3, 65, 7, dtype=dtype), torch.randn(3, 33, 7, dtype=dtype), k=33)
        check(distances, 1000 + torch.randn(50, 9, dtype=dtype), k=5)  # leave-one-out
    check(distances, torch.randn(20, 5, dtype=torch.bfloat16), torch.randn(4500, 5, dtype=torch.bfloat16), k=3)
    check(distances, torch.randn(6, 3), torch.randn(2100, 3), k=1900)  # past the queue: sorted
    check(distances, torch.full((300, 4), 2.0), k=40, grad=False)  # all ties: the buffer fills
    query = torch.randn(9, 4)
    query[2, 1] = float("nan")
    gallery = torch.randn(4200, 4)
    gallery[[5, 4100], 0] = float("nan")
    check(distances, query, gallery[:12], k=12, grad=False)
    check(distances, query, gallery, k=20, grad=False)


def covariance_pool():
    for dtype in (torch.float32, torch.float64):
        check(ops.covariance_pool, torch.randn(2, 33, 5, 7, dtype=dtype).relu())
        check(ops.covariance_pool, torch.randn(3, 9, 11, dtype=dtype), iterations=1, triu=False)
        check(
            ops.covariance_pool, torch.randn(2, 20, 3, 3, dtype=dtype).to(memory_format=torch.channels_last), sqrt=False
        )
    check(ops.covariance_pool, torch.randn(2, 16, 3, 3).bfloat16(), grad=False)


def pair_losses():
    """The losses with Triton kernels (their only CUDA kernels: run as triton:pair_losses)."""
    for loss in (ops.supcon_loss, ops.ntxent_loss):
        for dtype in (torch.float32, torch.float64):
            check(
                lambda e, labels, loss=loss: loss(e, labels, 0.1),
                torch.randn(37, 19, dtype=dtype),
                torch.arange(37) % 5,
            )
            check(
                lambda e, r, labels, rl, loss=loss: loss(e, labels, 0.1, ref_embeddings=r, ref_labels=rl),
                torch.randn(70, 33, dtype=dtype),
                torch.randn(41, 33, dtype=dtype),
                torch.arange(70) % 9,
                torch.arange(41) % 7,
            )
        check(lambda e, labels, loss=loss: loss(e, labels, 0.1), torch.randn(65, 8).bfloat16(), torch.arange(65) % 4)
    for miner_epsilon in (0.1, None):
        check(
            lambda e, r, labels, rl, m=miner_epsilon: ops.multi_similarity_loss(
                e, labels, miner_epsilon=m, ref_embeddings=r, ref_labels=rl
            ),
            torch.randn(70, 33),
            torch.randn(41, 33),
            torch.arange(70) % 9,
            torch.arange(41) % 7,
        )
        check(
            lambda e, labels, m=miner_epsilon: ops.multi_similarity_loss(e, labels, miner_epsilon=m),
            torch.randn(37, 19, dtype=torch.float64),
            torch.arange(37) % 5,
        )
    # contrastive_loss, triplets: near-duplicates far from the origin too (the exact distances'
    # paths).
    dup = 3.0 + 1e-4 * torch.randn(40, 24)
    for dtype in (torch.float32, torch.float64):
        for e in (torch.randn(70, 33, dtype=dtype), dup.to(dtype)):
            check(lambda e, labels: ops.contrastive_loss(e, labels, 0.1, 1.0), e, torch.arange(len(e)) % 9)
            for mining in ("all", "semi_hard", "batch_hard"):
                check(
                    lambda e, labels, m=mining: ops.triplet_margin_loss(e, labels, 0.1, mining=m),
                    e,
                    torch.arange(len(e)) % 9,
                )
        check(
            lambda e, r, labels, rl: ops.contrastive_loss(e, labels, ref_embeddings=r, ref_labels=rl),
            torch.randn(70, 33, dtype=dtype),
            torch.randn(41, 33, dtype=dtype),
            torch.arange(70) % 9,
            torch.arange(41) % 7,
        )
        for mining in ("all", "semi_hard", "batch_hard"):
            check(
                lambda e, r, labels, rl, m=mining: ops.triplet_margin_loss(
                    e, labels, mining=m, ref_embeddings=r, ref_labels=rl
                ),
                torch.randn(70, 33, dtype=dtype),
                torch.randn(41, 33, dtype=dtype),
                torch.arange(70) % 9,
                torch.arange(41) % 7,
            )
    for dtype in (torch.float32, torch.float64):
        check(
            ops.proxy_anchor_loss,
            torch.randn(70, 33, dtype=dtype),
            torch.arange(70) % 9,
            torch.randn(11, 33, dtype=dtype),
        )


OPS = (
    "cdist",
    "bilinear_pool",
    "covariance_pool",
    "knn",
    "label_smoothing_cross_entropy",
    "region_confusion",
    "pair_losses",
)
# Ops whose only CUDA kernels are Triton's: sanitized as triton:<op> only.
TRITON_ONLY = ("pair_losses",)

if __name__ == "__main__":
    name = sys.argv[1].removeprefix("triton:") if len(sys.argv) == 2 else ""
    if name not in OPS or (name in TRITON_ONLY and not sys.argv[1].startswith("triton:")):
        sys.exit(__doc__)
    torch.manual_seed(0)
    globals()[name]()
    torch.cuda.synchronize()
    print(f"{sys.argv[1]}: CUDA agrees with the CPU")
