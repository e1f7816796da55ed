"""The Triton path: which kernel serves each op's CUDA tensors, the kernels' launch
configurations one by one, and the shared exact arithmetic. The ops' own tests run through
the Triton kernels too (their "triton" parameter: tests/triton_testing.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton_testing
from testing import run_python

import torchkit
from torchkit import triton as triton_path

if triton_testing.available() is None:
    import triton
    import triton.language as tl

    from torchkit.triton import _math

    @triton.jit
    def _pow2_kernel(x_ptr, e_ptr, out_ptr, log_ptr, N: tl.constexpr, IS64: tl.constexpr):
        i = tl.arange(0, N)
        v = tl.load(x_ptr + i)
        tl.store(out_ptr + i, _math.ldexp(v, tl.load(e_ptr + i), IS64))
        tl.store(log_ptr + i, _math.ilogb(v, IS64))

    @triton.jit
    def _unmasked_sum_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
        """Sums a block's masked load without `other`: wrong wherever masked lanes are not 0."""
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr, tl.sum(tl.load(x_ptr + i, mask=i < N)))


@pytest.fixture(autouse=True)
def _poisoned_masked_loads():
    """Under the interpreter, masked-off lanes read NaN here as in the ops' Triton tests."""
    if triton_testing.INTERPRETING and triton_testing.available() is None:
        triton_testing.poison_masked_loads()


needs_triton = pytest.mark.skipif(triton_testing.available() is not None, reason=str(triton_testing.available()))
interpreted = pytest.mark.skipif(not triton_testing.INTERPRETING, reason="a GPU is visible: no interpreter")


@pytest.mark.parametrize(
    "op,has_cpp,selected,expected",
    [
        # Staged (never measured on a GPU): the C++ kernel by default, nothing without one.
        ("cdist", True, "auto", "cuda"),
        ("cdist", False, "auto", None),
        ("cdist", True, "triton", "triton"),
        ("cdist", False, "triton", "triton"),
        ("cdist", True, "cuda", "cuda"),
        ("cdist", False, "cuda", None),
        ("bilinear_pool", True, "auto", "cuda"),
        ("bilinear_pool", True, "triton", "triton"),
        # The pair losses have no CUDA C++ kernel: their staged Triton kernels serve only
        # when selected.
        ("pair_losses", False, "auto", None),
        ("pair_losses", False, "triton", "triton"),
        # An op without Triton kernels keeps its C++ kernel whatever is selected.
        ("knn", True, "triton", "cuda"),
        ("knn", False, "triton", None),
    ],
)
def test_which_kernel_serves_cuda_tensors(op, has_cpp, selected, expected):
    assert triton_path.decide(op, has_cpp, selected) == expected


def test_a_measured_triton_kernel_serves_by_default(monkeypatch):
    monkeypatch.setattr(triton_path, "MEASURED", frozenset({"cdist"}))
    assert triton_path.decide("cdist", True, "auto") == "triton"
    assert triton_path.decide("cdist", True, "cuda") == "cuda"


def test_every_triton_kernel_is_named_after_an_op_and_exists():
    """A module is named after its op, or after the family its ops share (csrc/<family>.h);
    each function it names exists."""
    import importlib
    from pathlib import Path

    ops = set(torchkit.kernels("cpu"))
    csrc = Path(__file__).resolve().parent.parent / "csrc"  # (torchkit may be a build's copy)
    for op, names in triton_path.TRITON_KERNELS.items():
        assert f"torchkit::{op}" in ops or (csrc / f"{op}.h").exists(), op
        for name, function in names.items():
            assert name in ops
            if triton_testing.available() is None:
                assert callable(getattr(importlib.import_module(f"torchkit.triton.{op}"), function)), function


def test_build_info_reports_what_serves_each_op():
    serving = torchkit.build_info()["cuda_kernels"]
    assert set(serving) == {name for name, has in torchkit.kernels("cuda").items() if has is not None}
    cpp = torchkit.build_info()["cuda"] is not None
    selected = triton_path.choice()
    for name, what in serving.items():
        op = next((o for o, names in triton_path.TRITON_KERNELS.items() if name in names), None)
        plain = "cuda" if cpp and name not in torchkit.CPU_ONLY else None
        assert what == (triton_path.decide(op, plain is not None, selected) if op else plain), (name, what)
        assert torchkit.kernels("cuda")[name] == (what is not None), name


@pytest.mark.skipif(triton_testing.available(True) is not None, reason=str(triton_testing.available(True)))
def test_selecting_triton_registers_its_kernels_for_cuda():
    out = run_python(
        "import torch, torchkit\n"
        "from torch._C import DispatchKey, DispatchKeySet\n"
        "info = torchkit.build_info()['cuda_kernels']\n"
        "print(info['torchkit::cdist'], info['torchkit::_cdist_backward'], info['torchkit::knn'],\n"
        "      info['torchkit::bilinear_pool'], info['torchkit::_bilinear_pool_backward'])\n"
        "print(torchkit.kernels('cuda')['torchkit::cdist'])\n"
        "x = torch.randn(7, 3, dtype=torch.float64)\n"
        "d = torch.ops.torchkit.cdist.default.redispatch(DispatchKeySet(DispatchKey.CUDA), x, None, False)\n"
        "print(torch.equal(d, torch.ops.torchkit.cdist(x, None, False)) or (d - torch.cdist(x, x)).abs().max().item() < 1e-12)\n",
        env={"TORCHKIT_CUDA_KERNELS": "triton", "TRITON_INTERPRET": "1"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    cpp = torchkit.build_info()["cuda"] is not None
    assert lines[0].split() == ["triton", "triton", "cuda" if cpp else "None", "triton", "triton"]
    assert lines[1:3] == ["True", "True"]


@pytest.mark.parametrize("value", ["tritn", "1", "cuda,triton"])
def test_a_bad_kernel_selection_names_the_variable(value):
    out = run_python("import torchkit", env={"TORCHKIT_CUDA_KERNELS": value})
    assert out.returncode != 0
    assert f"TORCHKIT_CUDA_KERNELS must be one of auto, triton, cuda (or unset), got {value!r}" in out.stderr


def test_interpreted_tests_stay_within_the_budget(request):
    """The suite's tests under Triton's interpreter (marked `triton`, not `cuda`) stay within
    conftest.INTERPRETER_TEST_BUDGET: they take most of `make test`'s time, so a new kernel adds
    its configuration tests and one slice of its op's semantics, not the op's whole suite again.
    Counted over the tests this run collected (the whole suite in `make test`)."""
    import conftest

    count = sum(map(conftest.interpreted, request.session.items))
    assert count <= conftest.INTERPRETER_TEST_BUDGET, (
        f"{count} tests run Triton kernels under the interpreter, past the budget of "
        f"{conftest.INTERPRETER_TEST_BUDGET} (tests/conftest.py)"
    )


def test_importing_torchkit_does_not_import_triton():
    out = run_python("import sys, torchkit, torchkit.ops\nprint('triton' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- shared arithmetic


@needs_triton
@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ldexp_and_ilogb_are_exact(dtype):
    """Against numpy's ldexp and frexp over the whole range: subnormals, over- and underflowing
    results, 0, ±inf and NaN."""
    is64 = dtype == torch.float64
    g = torch.Generator().manual_seed(0)
    n = 2048
    top = 1030 if is64 else 130
    low = -1080 if is64 else -155
    x = torch.ldexp(
        torch.rand(n, generator=g, dtype=torch.float64) + 0.5, torch.randint(low, top, (n,), generator=g).double()
    )
    x = (x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).to(dtype)
    x[:5] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan"), torch.finfo(dtype).tiny / 8], dtype=dtype)
    reach = 2 * top + 100
    e = torch.randint(-reach, reach, (n,), generator=g, dtype=torch.int32)
    e[::5] = torch.randint(-40, 40, (len(e[::5]),), generator=g, dtype=torch.int32)
    out = torch.empty_like(x)
    log = torch.empty(n, dtype=torch.int32)
    with np.errstate(all="ignore"):
        _pow2_kernel[(1,)](x, e, out, log, N=n, IS64=is64)
        expected = torch.from_numpy(np.ldexp(x.numpy(), e.numpy()).astype(x.numpy().dtype))
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])
    finite = x.isfinite() & (x != 0)
    assert torch.equal(log[finite], torch.from_numpy(np.frexp(x[finite].numpy())[1] - 1).to(torch.int32))


# --------------------------------------------------------------------------- cdist, every configuration


def _points(shape, dtype, seed, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (offset + torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


def _device():
    return "cpu" if triton_testing.INTERPRETING else "cuda"


@pytest.mark.triton("cdist", dispatch=False)  # (the ops: the C++ kernels)
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("config", range(3))  # every one of FORWARD_CONFIGS
@pytest.mark.parametrize("prefix", range(2))
def test_cdist_forward_in_every_configuration(dtype, config, prefix):
    """Ragged shapes (37 × 51 × 19 covers every edge of each block size), a NaN row,
    near-duplicate pairs far from the origin (in the first tile and in the last, ragged one,
    which forward_kernel must flag for recomputation; x[20] and x[36] for x2=None), x2=None
    and squared, against the C++ kernels."""
    from torchkit.triton import cdist as kernels

    assert len(kernels.FORWARD_CONFIGS) == 3  # each one parametrized
    x = _points((37, 19), dtype, 1, offset=30.0)
    y = _points((51, 19), dtype, 2, offset=30.0)
    y[5] = x[3] + 1e-3
    y[50] = x[36] + 1e-3
    x[20] = x[36] + 1e-3
    x[10, 4] = float("nan")
    tol = dict(rtol=2e-2, atol=0.25) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-5)
    for x2, squared in ((y, False), (None, True)):
        got = kernels.forward(
            x.to(_device()),
            None if x2 is None else x2.to(_device()),
            squared,
            config=kernels.FORWARD_CONFIGS[config],
            prefix_config=kernels.PREFIX_CONFIGS[prefix],
            fused_prefix=False,
        ).cpu()
        expected = torch.ops.torchkit.cdist(x, x2, squared)
        torch.testing.assert_close(got, expected, equal_nan=True, **tol)
        assert torch.equal(got.isnan(), expected.isnan())


@needs_triton  # (no kernel runs: not one of the interpreter's tests)
def test_cdist_forward_tiles_fill_the_gpu():
    """The forward's default tiles: 128 × 128 where they make enough programs for the SMs, the
    64 × 64 ones for a loss's batch (256² would be 4 programs), and float64's always."""
    from torchkit.triton import cdist as kernels

    first, last = kernels.FORWARD_CONFIGS[0], kernels.FORWARD_CONFIGS[-1]
    assert kernels._forward_default(torch.float32, 1, 8192, 8192) is first
    assert kernels._forward_default(torch.float32, 1, 2048, 2048) is first  # 256 tiles of 128²
    assert kernels._forward_default(torch.float32, 1, 2048, 1024) is last  # 128, for 132 SMs
    assert kernels._forward_default(torch.float32, 1, 256, 256) is last
    assert kernels._forward_default(torch.float32, 33, 256, 256) is first  # a batch of them
    assert kernels._forward_default(torch.float64, 1, 8192, 8192) is last


@pytest.mark.triton("cdist", dispatch=False)
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("config", range(3))
def test_cdist_fused_prefix_in_every_configuration(dtype, config):
    """prefix_kernel (one launch per batch element) forms what the per-set kernels do: the
    same exponents, finite rows' means, norms and operands, for one set and two, over ragged
    rows and features, a NaN row and an ±inf one, and batch elements at ordinary, huge and
    tiny magnitudes (scaled by a power of two) and all non-finite."""
    from torchkit.triton import cdist as kernels

    big = 1e200 if dtype == torch.float64 else 1e30
    x = torch.stack(
        [_points((37, 19), torch.float64, 6 + i, offset=3.0) * s for i, s in enumerate((1, big, 1 / big, 1))]
    )
    y = torch.stack([_points((51, 19), torch.float64, 9 + i) * s for i, s in enumerate((1, big, 1 / big, 1))])
    x[0, 10, 4], y[0, 7, 0] = float("nan"), float("-inf")
    x[3], y[3] = float("nan"), float("inf")
    x, y = x.to(dtype).to(_device()), y.to(dtype).to(_device())
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    products = kernels._products(x)
    for sets in ([x], [x, y]):
        split = kernels._Centring(sets, 4, 19, acc, products, kernels.PREFIX_CONFIGS[0], fused=False)
        fused = kernels._Centring(sets, 4, 19, acc, products, kernels.FUSED_PREFIX_CONFIGS[config], fused=True)
        assert torch.equal(fused.exponents, split.exponents)
        assert fused.exponents.tolist()[1:3] != [0, 0]
        for got, expected in ((fused.mean, split.mean), *zip(fused.norms, split.norms, strict=True)):
            torch.testing.assert_close(
                got, expected, equal_nan=True, rtol=1e-12 if acc == torch.float64 else 1e-5, atol=0
            )
        for (hi, lo), (hi_, lo_) in zip(fused.operands, split.operands, strict=True):
            # The means differ in the order of their sums (an ulp of the mean), which may move
            # a value's split between hi and lo: their sums are compared.
            got = hi.double() + (lo.double() if lo is not hi else 0)
            expected = hi_.double() + (lo_.double() if lo_ is not hi_ else 0)
            torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=1e-6)


@pytest.mark.triton("cdist", dispatch=False)  # (the ops: the C++ kernels)
@needs_triton
# Every one of GRAD_CONFIGS in float32; float64 in its default, the last.
@pytest.mark.parametrize(
    "dtype,config", [(torch.float32, 0), (torch.float32, 1), (torch.float32, 2), (torch.float64, 2)]
)
@pytest.mark.parametrize("self_", [False, True])
def test_cdist_backward_in_every_configuration(dtype, config, self_):
    """The backward's kernels with each configuration, near-duplicates (whose gradient is taken
    directly) and a zero distance included, against the C++ kernels."""
    from torchkit.triton import cdist as kernels

    assert len(kernels.GRAD_CONFIGS) == 3  # each one parametrized
    x = _points((37, 19), dtype, 3, offset=30.0)
    y = None if self_ else _points((51, 19), dtype, 4, offset=30.0)
    if self_:
        x[7] = x[2]  # distance 0: zero gradient
        x[9] = x[2] + 1e-4
    else:
        y[5] = x[3] + 1e-4
    for squared in (False, True):
        d = torch.ops.torchkit.cdist(x, y, squared)
        grad = _points(d.shape, dtype, 5)
        to = _device()
        got = kernels.backward(
            grad.to(to),
            x.to(to),
            None if y is None else y.to(to),
            d.to(to),
            squared,
            [True, True],
            config=kernels.GRAD_CONFIGS[config],
        )
        expected = torch.ops.torchkit._cdist_backward(grad, x, y, d, squared, [True, True])
        for a, b in zip(got, expected, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=1e-4)


# The largest error against float64 of cdist's float32 products under each fp32-matmul setting,
# relative to the rows' magnitude (the distances and the gradients alike), and how much smaller
# the default's must be than "medium"'s (so that the setting reaches the kernels).
CDIST_SCHEMES = [("highest", 2e-6), ("high", 3e-3), ("medium", 3e-2)]


@pytest.mark.triton("cdist", dispatch=False)  # (the ops: the C++ kernels)
@needs_triton
def test_cdist_float32_products_follow_the_fp32_matmul_setting():
    """float32 inputs on tensor cores by PyTorch's fp32-matmul setting, read at each call: the
    default as accurate as IEEE float32 products, "high" TF32, "medium" bfloat16; forward and
    backward within each scheme's error of float64's, the default's far smaller than
    "medium"'s; near-duplicates (refined exactly) included."""
    from torchkit.triton import cdist as kernels

    x = _points((37, 64), torch.float32, 6, offset=3.0)
    y = _points((51, 64), torch.float32, 7, offset=3.0)
    y[5] = x[3] + 1e-3
    exact = torch.cdist(x.double(), y.double())
    grad = _points(exact.shape, torch.float32, 8)
    expected = torch.ops.torchkit._cdist_backward(grad.double(), x.double(), y.double(), exact, False, [True, True])
    scale = x.double().abs().amax().item()
    before = torch.get_float32_matmul_precision()
    errors = {}
    to = _device()
    for setting, tol in CDIST_SCHEMES:
        try:
            torch.set_float32_matmul_precision(setting)
            got = kernels.forward(x.to(to), y.to(to), False).cpu()
            grads = kernels.backward(grad.to(to), x.to(to), y.to(to), got.to(to), False, [True, True])
        finally:
            torch.set_float32_matmul_precision(before)
        errors[setting] = (got.double() - exact).abs().amax().item() / scale
        assert errors[setting] <= tol, (setting, errors[setting])
        assert (got.double() - exact)[3, 5].abs() <= 1e-6 * exact[3, 5]  # (refined: exact)
        for a, b in zip(grads, expected, strict=True):
            g_scale = b.abs().amax().item()
            assert (a.cpu().double() - b).abs().amax().item() <= 4 * tol * g_scale, setting
    assert errors["highest"] * 100 < errors["medium"], errors


# --------------------------------------------------------------------------- bilinear_pool, every configuration


def _feature_maps(dtype, E, scale=1.0):
    """Ragged sizes (37 and 19 channels, 5 × 7 positions: every edge of each block size), three
    samples: ordinary, one with a NaN (NaN output, and its own only) and one at `scale` (scaled
    where it leaves the unscaled window)."""
    x = _points((3, 37, 5, 7), torch.float64, 1).relu()
    y = None if E is None else _points((3, E, 5, 7), torch.float64, 2)
    x[1, 4, 2, 3] = float("nan")
    x[2] *= scale
    if y is not None:
        y[2] *= scale
    return x.to(dtype), None if y is None else y.to(dtype)


def _bilinear_tolerance(dtype):
    return {
        torch.float64: dict(rtol=1e-12, atol=1e-14),
        torch.float32: dict(rtol=1e-5, atol=1e-6),
        torch.bfloat16: dict(rtol=2e-2, atol=1e-2),
    }[dtype]


@pytest.mark.triton("bilinear_pool", dispatch=False)  # (the ops: the C++ kernels)
@needs_triton
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1.0), (torch.float64, 1e200), (torch.bfloat16, 1e25)])
@pytest.mark.parametrize("config", range(3))
@pytest.mark.parametrize("elementwise", range(2))
def test_bilinear_pool_forward_in_every_configuration(dtype, scale, config, elementwise):
    """y = None and y given, channels_last too, against the C++ kernels: output and norm (negated
    for the scaled sample)."""
    from torchkit.triton import bilinear_pool as kernels

    for E, channels_last in ((None, False), (19, False), (19, True)):
        x, y = _feature_maps(dtype, E, scale)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
            y = y.to(memory_format=torch.channels_last)
        out, norm = kernels.forward(
            x.to(_device()),
            None if y is None else y.to(_device()),
            1e-5,
            1e-12,
            config=kernels.FORWARD_CONFIGS[config],
            elementwise_config=kernels.ELEMENTWISE_CONFIGS[elementwise],
        )
        expected, expected_norm = torch.ops.torchkit.bilinear_pool(x, y, 1e-5, 1e-12)
        torch.testing.assert_close(out.cpu(), expected, equal_nan=True, **_bilinear_tolerance(dtype))
        assert torch.equal(out.cpu().isnan(), expected.isnan())
        torch.testing.assert_close(norm.cpu(), expected_norm, equal_nan=True, rtol=1e-5, atol=0)
        assert (norm[2] < 0).item() == (scale != 1.0 and dtype != torch.float32)


@pytest.mark.triton("bilinear_pool", dispatch=False)  # (the ops: the C++ kernels)
@needs_triton
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e-30), (torch.float64, 1.0), (torch.bfloat16, 1.0)])
@pytest.mark.parametrize("config", range(2))
@pytest.mark.parametrize("elementwise", range(2))
def test_bilinear_pool_backward_in_every_configuration(dtype, scale, config, elementwise):
    """Both gradients, y = None and y given, channels_last (gradients in the inputs' layout) and
    an expanded upstream gradient, against the C++ kernels given the same output and norm."""
    from torchkit.triton import bilinear_pool as kernels

    for E, channels_last, expanded in ((None, False, False), (19, False, True), (19, True, False)):
        x, y = _feature_maps(dtype, E, scale)
        x[1] = x[0]  # no NaN here: the backward's comparison is over every entry
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
            y = y.to(memory_format=torch.channels_last)
        out, norm = torch.ops.torchkit.bilinear_pool(x, y, 1e-5, 1e-12)
        grad = torch.full((), 0.5, dtype=dtype).expand_as(out) if expanded else _points(out.shape, dtype, 5)
        mask = [True, y is not None]
        to = _device()
        got = kernels.backward(
            grad.to(to),
            x.to(to),
            None if y is None else y.to(to),
            out.to(to),
            norm.to(to),
            1e-5,
            1e-12,
            mask,
            config=kernels.GRAD_CONFIGS[config],
            elementwise_config=kernels.ELEMENTWISE_CONFIGS[elementwise],
        )
        expected = torch.ops.torchkit._bilinear_pool_backward(grad, x, y, out, norm, 1e-5, 1e-12, mask)
        for a, b in zip(got, expected, strict=True):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            if b.numel():
                scale_of = b.double().abs().amax((1, 2, 3), keepdim=True)  # per sample: a GEMM's accuracy
                err = (a.cpu().double() - b.double()).abs() / scale_of
                assert err.max() <= _bilinear_tolerance(dtype)["rtol"] * 2, err.max()


def _errors_against(exact, exact_grads, out, grads):
    """The largest error of an output and of its gradients against float64's, each relative to
    the largest float64 entry."""
    value = (out.cpu().double() - exact).abs().amax().item() / exact.abs().amax().item()
    pairs = [(a, b) for a, b in zip(grads, exact_grads, strict=True) if b.numel()]
    return value, max((a.cpu().double() - b).abs().amax().item() / b.abs().amax().item() for a, b in pairs)


@pytest.mark.triton("bilinear_pool", dispatch=False)  # (the ops: the C++ kernels)
@needs_triton
def test_bilinear_pool_float32_products_follow_the_fp32_matmul_setting():
    """float32 features on tensor cores by PyTorch's fp32-matmul setting, read at each call: the
    default as accurate as the CPU kernel's IEEE float32 products (within 4× its error against
    float64, outputs and gradients; ReLU features and a two-stream pair of signed ones, whose
    small Z entries the signed square root magnifies), "high" TF32, "medium" bfloat16 (within
    their errors, the default's far smaller than "medium"'s: the setting reaches the kernels)."""
    from torchkit.triton import bilinear_pool as kernels

    g = torch.Generator().manual_seed(9)
    relu = (0.5 + torch.randn(3, 37, 5, 7, generator=g, dtype=torch.float64)).relu()
    signed = [torch.randn(3, c, 7, 7, generator=g, dtype=torch.float64) for c in (19, 23)]
    before = torch.get_float32_matmul_precision()
    to = _device()
    # "high"'s and "medium"'s bounds (output, gradients): the signed pair's small Z entries
    # take the rounding of the large ones through the square root's slope.
    cases = ((relu, None, (1e-3, 1e-3), (1e-2, 1e-2)), (*signed, (1e-2, 1e-1), (1e-1, 1.0)))
    for x, y, high, medium in cases:
        mask = [True, y is not None]
        exact, norm = torch.ops.torchkit.bilinear_pool(x, y, 1e-5, 1e-12)
        grad = _points(exact.shape, torch.float64, 10)
        exact_grads = torch.ops.torchkit._bilinear_pool_backward(grad, x, y, exact, norm, 1e-5, 1e-12, mask)
        x32, y32, g32 = x.float(), None if y is None else y.float(), grad.float()
        cpu_out, cpu_norm = torch.ops.torchkit.bilinear_pool(x32, y32, 1e-5, 1e-12)
        cpu_grads = torch.ops.torchkit._bilinear_pool_backward(g32, x32, y32, cpu_out, cpu_norm, 1e-5, 1e-12, mask)
        ieee = _errors_against(exact, exact_grads, cpu_out, cpu_grads)
        found = {}
        for setting, tol in (("highest", tuple(4 * e for e in ieee)), ("high", high), ("medium", medium)):
            try:
                torch.set_float32_matmul_precision(setting)
                out, n = kernels.forward(x32.to(to), None if y is None else y32.to(to), 1e-5, 1e-12)
                grads = kernels.backward(
                    g32.to(to), x32.to(to), None if y is None else y32.to(to), out, n, 1e-5, 1e-12, mask
                )
            finally:
                torch.set_float32_matmul_precision(before)
            found[setting] = _errors_against(exact, exact_grads, out, grads)
            assert all(e <= t for e, t in zip(found[setting], tol, strict=True)), (setting, found[setting], tol)
        assert found["highest"][0] * 100 < found["medium"][0], found


@needs_triton
@interpreted
def test_poisoned_lanes_catch_a_kernel_that_reads_them():
    """The harness itself: a masked load without `other` reads NaN under the patch."""
    if not triton_testing.poison_masked_loads():
        pytest.skip("this Triton's interpreter is not the one the patch knows")
    out = torch.empty(1)
    _unmasked_sum_kernel[(1,)](torch.ones(5), out, 5, BLOCK=8)
    assert out.isnan().all()


@needs_triton
@pytest.mark.bad_input
@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(3), None, False),
        (torch.randn(4, 3), torch.randn(4, 2), False),
        (torch.randn(4, 3), torch.randn(4, 3, dtype=torch.float64), False),
        (torch.randint(5, (4, 3)), None, False),
        (torch.randn(2, 4, 3), torch.randn(3, 5, 3), False),
        (torch.randn(4, 3), None, 1),
        (torch.randn(4, 3), None, 0.5),
    ],
)
def test_cdist_kernels_refuse_what_the_cpp_kernels_refuse(args):
    """The raw op's CUDA kernel validates everything it reads, as the C++ kernels do, with the
    same exception and message."""
    from torchkit.triton import cdist as kernels

    with pytest.raises(Exception) as cpp:
        torch.ops.torchkit.cdist(*args)
    with pytest.raises(type(cpp.value)) as triton_err:
        kernels.forward(*args)
    assert str(triton_err.value) == str(cpp.value).split("\n")[0]


@needs_triton
@pytest.mark.bad_input
def test_cdist_backward_kernel_checks_grad_and_dist():
    from torchkit.triton import cdist as kernels

    x1, x2 = torch.randn(4, 3), torch.randn(5, 3)
    d = torch.ops.torchkit.cdist(x1, x2, False)
    for grad, dist in ((torch.randn(4, 4), d), (torch.randn_like(d), d.double()), (torch.randn_like(d), d[:3])):
        with pytest.raises(Exception) as cpp:
            torch.ops.torchkit._cdist_backward(grad, x1, x2, dist, False, [True, True])
        with pytest.raises(type(cpp.value)) as triton_err:
            kernels.backward(grad, x1, x2, dist, False, [True, True])
        assert str(triton_err.value) == str(cpp.value).split("\n")[0]


_X4 = torch.randn(2, 3, 4, 4)


@needs_triton
@pytest.mark.bad_input
@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(3, 4, 4), None, 1e-5, 1e-12),
        (_X4, torch.randn(3, 2, 4, 4), 1e-5, 1e-12),
        (_X4, torch.randn(2, 2, 4, 4, dtype=torch.float64), 1e-5, 1e-12),
        (_X4.long(), None, 1e-5, 1e-12),
        (_X4, None, -1.0, 1e-12),
        (_X4, None, 1e-5, float("nan")),
        (_X4, None, True, 1e-12),
        (torch.randn(2, 3, 0, 4), None, 1e-5, 1e-12),
    ],
)
def test_bilinear_pool_kernels_refuse_what_the_cpp_kernels_refuse(args):
    from torchkit.triton import bilinear_pool as kernels

    with pytest.raises(Exception) as cpp:
        torch.ops.torchkit.bilinear_pool(*args)
    with pytest.raises(type(cpp.value)) as triton_err:
        kernels.forward(*args)
    assert str(triton_err.value) == str(cpp.value).split("\n")[0]


@needs_triton
@pytest.mark.bad_input
def test_bilinear_pool_backward_kernel_checks_its_inputs():
    from torchkit.triton import bilinear_pool as kernels

    out, norm = torch.ops.torchkit.bilinear_pool(_X4, None, 1e-5, 1e-12)
    g = torch.randn_like(out)
    for args in (
        (torch.randn(2, 8), _X4, None, out, norm),
        (g, _X4, None, out[:1], norm),
        (g, _X4, None, out, norm.double()),
        (g, _X4, None, out, norm[:1]),
        (g.double(), _X4, None, out, norm),
        (g, _X4, None, out.double(), norm),
    ):
        with pytest.raises(Exception) as cpp:
            torch.ops.torchkit._bilinear_pool_backward(*args, 1e-5, 1e-12, [True, False])
        with pytest.raises(type(cpp.value)) as triton_err:
            kernels.backward(*args, 1e-5, 1e-12, [True, False])
        assert str(triton_err.value) == str(cpp.value).split("\n")[0]


@needs_triton
@pytest.mark.cuda
def test_cdist_triton_forward_needs_no_memory_beyond_its_output():
    """Peak extra memory of the Triton forward: the output, plus per-row and per-tile
    statistics (no P×R scratch, no copy of the inputs), bfloat16 included."""
    from torchkit.triton import cdist as kernels

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, 128, device="cuda").to(dtype)
        y = torch.randn(4096, 128, device="cuda").to(dtype)
        kernels.forward(x, y, False)  # compiled before measuring
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = kernels.forward(x, y, False)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
        assert extra <= 2 * (x.shape[0] + y.shape[0]) * 16 + 64 * 1024, extra


@needs_triton
@pytest.mark.cuda
def test_bilinear_pool_triton_forward_needs_no_memory_beyond_its_output():
    """Peak extra memory of the Triton forward: the output (plus, for bfloat16, the float32 s it
    normalises from, as the CPU kernel keeps), and per-sample and per-tile statistics; no copy
    of the inputs, channels_last read in place."""
    from torchkit.triton import bilinear_pool as kernels

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(16, 256, 14, 14, device="cuda").to(dtype).to(memory_format=torch.channels_last)
        kernels.forward(x, None, 1e-5, 1e-12)  # compiled before measuring
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out, _ = kernels.forward(x, None, 1e-5, 1e-12)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
        scratch = 0 if dtype == torch.float32 else out.numel() * 4
        assert extra <= scratch + 256 * 1024, extra
