"""The CPU kernels' float32 products stay IEEE whatever PyTorch's fp32-matmul setting says.

torch.set_float32_matmul_precision("medium") lets ATen's CPU matmuls round float32 operands to
bfloat16 (oneDNN, on CPUs with AVX512-BF16 or AMX), "high" to TF32 (on AMX-FP16): that is the
CUDA precision contract, which the CPU kernels do not follow (docs/ops.md). Each op's float32
outputs and gradients under a reduced setting are as close to its float64 results as under the
default; bfloat16 products would be about 2^16 times farther. On a CPU without those
instructions the setting changes nothing and the test still holds.
"""

import pytest
import torch

import torchkit

D = 64


def _embeddings(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randint(0, 8, (n,), generator=g)


def _cdist(dtype, self_mode):
    g = torch.Generator().manual_seed(0)
    x1 = (torch.randn(2, 120, D, generator=g) + 3).to(dtype).requires_grad_()
    x2 = None if self_mode else (torch.randn(2, 90, D, generator=g) + 3).to(dtype).requires_grad_()
    return torchkit.ops.cdist(x1, x2), [t for t in (x1, x2) if t is not None]


def _knn(dtype):
    g = torch.Generator().manual_seed(6)
    query = (torch.randn(150, D, generator=g) + 3).to(dtype).requires_grad_()
    gallery = (torch.randn(300, D, generator=g) + 3).to(dtype).requires_grad_()
    return torchkit.ops.knn(query, gallery, k=8)[0], [query, gallery]


def _pool(op, dtype, two_inputs):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, D, 6, 6, generator=g).to(dtype).requires_grad_()
    y = torch.randn(3, 48, 6, 6, generator=g).to(dtype).requires_grad_() if two_inputs else None
    out = op(x) if y is None else op(x, y)
    return out, [t for t in (x, y) if t is not None]


def _pair_loss(loss, dtype, **kwargs):
    e, labels = _embeddings(128, 2)
    e = e.to(dtype).requires_grad_()
    return loss(e, labels, **kwargs), [e]


def _proxy_anchor(dtype):
    e, labels = _embeddings(128, 3)
    proxies = torch.randn(8, D, generator=torch.Generator().manual_seed(4))
    e, proxies = e.to(dtype).requires_grad_(), proxies.to(dtype).requires_grad_()
    return torchkit.ops.proxy_anchor_loss(e, labels, proxies), [e, proxies]


CASES = {
    "cdist": lambda dt: _cdist(dt, self_mode=False),
    "cdist self": lambda dt: _cdist(dt, self_mode=True),
    "knn": _knn,
    "bilinear_pool": lambda dt: _pool(torchkit.ops.bilinear_pool, dt, two_inputs=True),
    "bilinear_pool self": lambda dt: _pool(torchkit.ops.bilinear_pool, dt, two_inputs=False),
    "covariance_pool": lambda dt: _pool(torchkit.ops.covariance_pool, dt, two_inputs=False),
    "supcon": lambda dt: _pair_loss(torchkit.ops.supcon_loss, dt),
    "ntxent": lambda dt: _pair_loss(torchkit.ops.ntxent_loss, dt),
    "contrastive": lambda dt: _pair_loss(torchkit.ops.contrastive_loss, dt),
    "triplet all": lambda dt: _pair_loss(torchkit.ops.triplet_margin_loss, dt),
    "triplet semi_hard": lambda dt: _pair_loss(torchkit.ops.triplet_margin_loss, dt, mining="semi_hard"),
    "triplet batch_hard": lambda dt: _pair_loss(torchkit.ops.triplet_margin_loss, dt, mining="batch_hard"),
    "multi_similarity": lambda dt: _pair_loss(torchkit.ops.multi_similarity_loss, dt),
    "proxy_anchor": _proxy_anchor,
}


def _results(case, dtype):
    """The op's output and its inputs' gradients under a fixed random upstream gradient."""
    out, inputs = CASES[case](dtype)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad((out * weight.to(dtype)).sum(), inputs)
    return [out.detach(), *grads]


def _errors(results, exact):
    """Each result's largest error against float64, relative to the float64 result's scale."""
    return [
        ((r.double() - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
        for r, e in zip(results, exact, strict=True)
    ]


@pytest.fixture
def matmul_setting():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("setting", ["medium", "high"])
@pytest.mark.parametrize("case", CASES)
def test_cpu_float32_products_ignore_the_fp32_matmul_setting(case, setting, matmul_setting):
    matmul_setting("highest")
    exact = _results(case, torch.float64)
    default = _errors(_results(case, torch.float32), exact)
    matmul_setting(setting)
    reduced = _errors(_results(case, torch.float32), exact)
    eps = torch.finfo(torch.float32).eps
    names = ["output"] + [f"gradient {i}" for i in range(1, len(reduced))]
    for name, r, d in zip(names, reduced, default, strict=True):
        assert r <= max(4 * d, 64 * eps), f"{case} under {setting!r}: {name} off by {r:.2e} (default {d:.2e})"
