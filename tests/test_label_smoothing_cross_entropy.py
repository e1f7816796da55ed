"""torchkit.ops.label_smoothing_cross_entropy against F.cross_entropy and the reference."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from testing import (
    DEVICES,
    FLOAT_DTYPES,
    REDUCED_DTYPES,
    assert_close,
    assert_close_reduced,
    assert_device_side_assert,
    check_compile,
    check_compiled_refuses_like_eager,
    check_cuda_matches_cpu,
    check_gradcheck,
    check_meta_refuses_like_eager,
    check_opcheck,
    make_noncontiguous,
)

import torchkit
from torchkit import ops, reference

OP = torch.ops.torchkit.label_smoothing_cross_entropy.default
BACKWARD = torch.ops.torchkit._label_smoothing_cross_entropy_backward.default

# (input shape, target kind): the forms F.cross_entropy accepts.
FORMS = [
    ((7,), "index"),
    ((5, 7), "index"),
    ((3, 6, 4, 5), "index"),
    ((7,), "prob"),
    ((5, 7), "prob"),
    ((3, 6, 4, 5), "prob"),
]


def make_case(shape, kind, dtype=torch.float32, device="cpu", ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).to(device)
    class_dim = 0 if len(shape) == 1 else 1
    C = shape[class_dim]
    if kind == "prob":
        t = torch.randn(shape, generator=g, dtype=torch.float64).softmax(class_dim).to(dtype).to(device)
    else:
        pos = shape[:class_dim] + shape[class_dim + 1 :]
        t = torch.randint(C, pos, generator=g)
        if ignore and t.numel() > 1:
            t.view(-1)[:: max(2, t.numel() // 3)] = -100  # a few ignored positions
        t = t.to(device)
    w = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(device)
    return x, t, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,kind", FORMS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("contiguous", [True, False])
def test_matches_f_cross_entropy(device, shape, kind, reduction, weighted, eps, contiguous):
    x, t, w = make_case(shape, kind, torch.float64, device)
    if not contiguous:
        x = make_noncontiguous(x)
        t = make_noncontiguous(t)
    x.requires_grad_()
    kw = dict(weight=w if weighted else None, reduction=reduction, label_smoothing=eps)
    ours = ops.label_smoothing_cross_entropy(x, t, **kw)
    theirs = F.cross_entropy(x, t, **kw)
    ref = reference.label_smoothing_cross_entropy(x, t, **kw)
    assert_close(ours, theirs)
    assert_close(ref, theirs)
    g = torch.randn_like(theirs)
    (ga,) = torch.autograd.grad(ours, x, g)
    (gb,) = torch.autograd.grad(theirs, x, g)
    assert_close(ga, gb)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["index", "prob"])
def test_dtypes(device, dtype, kind):
    x, t, w = make_case((33, 301), kind, dtype, device)
    x.requires_grad_()
    out = ops.label_smoothing_cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction="none")
    assert out.dtype == F.cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction="none").dtype
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.dtype == dtype
    x64, t64, w64 = x.detach().double().requires_grad_(), (t.double() if kind == "prob" else t), w.double()
    ref = F.cross_entropy(x64, t64, weight=w64, label_smoothing=0.1, reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), x64)
    if dtype in REDUCED_DTYPES:
        # The plain composition in float32, rounded: the baseline the fused kernel must match.
        x32 = x.detach().float().requires_grad_()
        base = F.cross_entropy(
            x32, t.float() if kind == "prob" else t, weight=w.float(), label_smoothing=0.1, reduction="none"
        )
        (base_grad,) = torch.autograd.grad(base.sum(), x32)
        assert_close_reduced(out, base.to(dtype), ref)
        assert_close_reduced(grad, base_grad.to(dtype), ref_grad)
    else:
        assert_close(out, ref.to(dtype))
        assert_close(grad, ref_grad.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_target_gradient_kept_in_float32(device):
    # Liger #1268: the target-class term (softmax - 1) loses its digits if rounded early.
    x = torch.zeros(2, 4096, dtype=torch.bfloat16, device=device)
    x[:, 7] = 12.0  # softmax of the target close to 1
    x.requires_grad_()
    t = torch.tensor([7, 7], device=device)
    ops.label_smoothing_cross_entropy(x, t, label_smoothing=0.0).backward()
    x64 = x.detach().double().requires_grad_()
    F.cross_entropy(x64, t, label_smoothing=0.0).backward()
    torch.testing.assert_close(x.grad[:, 7].double(), x64.grad[:, 7], rtol=8e-3, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["index", "prob"])
@pytest.mark.parametrize("weighted", [False, True])
def test_exclude_target_is_the_cookbook_formula(device, kind, weighted):
    x, t, w = make_case((6, 9), kind, torch.float64, device, ignore=False)
    eps, C = 0.1, 9
    w = w if weighted else None
    # The cookbook's snippet, generalised to probabilities: the target keeps 1 - ε of its mass,
    # the other C - 1 classes share ε.
    y = t if kind == "prob" else F.one_hot(t, C).double()
    smoothed = (1 - eps) * y + eps * (1 - y) / (C - 1)
    per_class = -F.log_softmax(x, 1) * smoothed * (1 if w is None else w)
    denominator = 6 if (kind == "prob" or w is None) else w[t].sum()
    expected = per_class.sum() / denominator
    ours = ops.label_smoothing_cross_entropy(x, t, weight=w, label_smoothing=eps, exclude_target=True)
    assert_close(ours, expected)
    assert_close(
        reference.label_smoothing_cross_entropy(x, t, weight=w, label_smoothing=eps, exclude_target=True), expected
    )


def test_exclude_target_with_ignore_index_matches_reference():
    x, t, w = make_case((3, 5, 4), "index", torch.float64)
    for reduction in ("mean", "sum", "none"):
        kw = dict(weight=w, reduction=reduction, label_smoothing=0.3, exclude_target=True)
        assert_close(ops.label_smoothing_cross_entropy(x, t, **kw), reference.label_smoothing_cross_entropy(x, t, **kw))


@pytest.mark.parametrize("device", DEVICES)
def test_pytorch_bug_cases(device):
    x, t, w = make_case((8, 10), "index", torch.float64, device)
    t[:4] = -100
    # #73205: ignored rows must not count in the smoothing term; #69339: weight + smoothing +
    # ignore_index together.
    for kw in (dict(), dict(weight=w)):
        for red in ("mean", "sum", "none"):
            a = ops.label_smoothing_cross_entropy(x, t, reduction=red, label_smoothing=0.2, **kw)
            assert_close(a, F.cross_entropy(x, t, reduction=red, label_smoothing=0.2, **kw))
    t2 = torch.full_like(t, 3)
    t2[0] = 9
    assert_close(
        ops.label_smoothing_cross_entropy(x, t2, ignore_index=3, weight=w),
        F.cross_entropy(x, t2, ignore_index=3, weight=w, label_smoothing=0.1),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored(device):
    x = torch.randn(4, 5, device=device, requires_grad=True)
    t = torch.full((4,), -100, device=device)
    for red in ("mean", "sum", "none"):
        ours = ops.label_smoothing_cross_entropy(x, t, reduction=red)
        theirs = F.cross_entropy(x, t, reduction=red, label_smoothing=0.1)
        torch.testing.assert_close(ours, theirs, equal_nan=True)
    ops.label_smoothing_cross_entropy(x, t, reduction="sum").backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.bad_input
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_logits_propagate_like_pytorch(device):
    x = torch.randn(4, 6, device=device)
    x[0, 1] = float("nan")
    x[1, 2] = float("inf")
    x[2, 3] = float("-inf")  # masking: finite with ε = 0
    t = torch.tensor([0, 1, 2, 4], device=device)
    for eps in (0.0, 0.1):
        ours = ops.label_smoothing_cross_entropy(x, t, reduction="none", label_smoothing=eps)
        theirs = F.cross_entropy(x, t, reduction="none", label_smoothing=eps)
        torch.testing.assert_close(ours, theirs, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", [1e3, 1e6, 1e8, -1e6])
def test_shift_invariant_like_f_cross_entropy(device, v):
    # The loss depends only on differences of logits; absolute sums would round at v's scale.
    x = torch.tensor([[v, v + 1, v - 0.5]], device=device, requires_grad=True)
    t = torch.tensor([1], device=device)
    ours = ops.label_smoothing_cross_entropy(x, t, label_smoothing=0.1)
    theirs = F.cross_entropy(x, t, label_smoothing=0.1)
    assert_close(ours, theirs)
    assert_close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape,kind", [((64, 100), "index"), ((64, 100), "prob"), ((4, 9, 6, 5), "index"), ((2, 40_000), "index")]
)
@pytest.mark.parametrize("weighted", [False, True])
def test_far_from_zero_logits_match_a_float64_oracle(device, shape, kind, weighted):
    # Logits of 1000 + 2·N(0,1) in float32: the float64 computation on the same values is
    # the oracle; every per-position loss and every gradient element within float32 tolerance.
    x, t, w = make_case(shape, kind, torch.float32, device, ignore=False)
    x = (1000 + (2 / 3) * x).detach().requires_grad_()
    kw = dict(weight=w if weighted else None, reduction="none", label_smoothing=0.1)
    ours = ops.label_smoothing_cross_entropy(x, t, **kw)
    x64 = x.detach().double().requires_grad_()
    kw64 = dict(kw, weight=w.double() if weighted else None)
    oracle = F.cross_entropy(x64, t.double() if kind == "prob" else t, **kw64)
    torch.testing.assert_close(ours.double(), oracle, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(oracle)
    torch.testing.assert_close(
        torch.autograd.grad(ours, x, g.float())[0].double(),
        torch.autograd.grad(oracle, x64, g)[0],
        rtol=1e-4,
        atol=1e-6,
    )


def huge_logits(shape, kind, dtype, scale, seed=0):
    """Logits of magnitude `scale` (either sign) whose differences are a few ulps of it: the
    softmax is far from one-hot at any scale. Index targets, or probability targets."""
    g = torch.Generator().manual_seed(seed)
    ulps = torch.randint(-3, 4, shape, generator=g, dtype=torch.float64)
    x = (scale * (1 + torch.finfo(dtype).eps * ulps)).to(dtype)
    x.view(-1)[: shape[-1]] = torch.tensor(scale, dtype=dtype)  # some rows of equal logits
    class_dim = 1 if len(shape) > 1 else 0
    if kind == "prob":
        t = torch.randn(shape, generator=g, dtype=torch.float64).softmax(class_dim).to(dtype)
    else:
        t = torch.randint(shape[class_dim], shape[:class_dim] + shape[class_dim + 1 :], generator=g)
    return x, t


# Both ends of each dtype's range, and the magnitudes where the saved float64 lse loses log Σ.
HUGE = [(torch.float32, s) for s in (1e-30, 1e8, 1e13, 1e18, 1e30, -1e30, 3e38)] + [
    (torch.float64, s) for s in (1e-300, 1e4, 1e16, 1e100, -1e300, 1e300)
]


# (3, 5000): rows long enough that every thread of a CUDA row block holds classes.
SHAPES_AND_TARGETS = [((5, 9), "index"), ((5, 9), "prob"), ((3, 5000), "index"), ((2, 9, 3, 2), "index")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,scale", HUGE)
@pytest.mark.parametrize("shape,kind", SHAPES_AND_TARGETS)
def test_gradient_at_any_magnitude_matches_pytorch_in_float64(device, dtype, scale, shape, kind):
    # softmax = exp((x − max) − log Σ) is exact at any magnitude; exp(x − lse) with one rounded
    # lse is not: past |lse| ≈ 2⁵³ a row of equal logits would get softmax 1 for every class.
    x, t = huge_logits(shape, kind, dtype, scale)
    x, t = x.to(device).requires_grad_(), t.to(device)
    kw = dict(reduction="none", label_smoothing=0.1)
    ours = ops.label_smoothing_cross_entropy(x, t, **kw)
    x64 = x.detach().double().requires_grad_()
    oracle = F.cross_entropy(x64, t.double() if kind == "prob" else t, **kw)
    g = torch.randn(oracle.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    (ga,) = torch.autograd.grad(ours, x, g.to(dtype))
    (gb,) = torch.autograd.grad(oracle, x64, g)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ga.double(), gb, **tol)
    # Forward-mode AD runs the same backward kernel.
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    (_, jvp) = torch.func.jvp(
        lambda a: ops.label_smoothing_cross_entropy(a, t, **kw), (x.detach(),), (tangent.to(dtype),)
    )
    (_, jvp64) = torch.func.jvp(
        lambda a: F.cross_entropy(a, t.double() if kind == "prob" else t, **kw), (x64.detach(),), (tangent,)
    )
    torch.testing.assert_close(jvp.double(), jvp64, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,scale", HUGE)
def test_probability_target_gradient_at_any_magnitude(device, dtype, scale):
    # ∂ℓ/∂p_c = a·(lse − x_c): −log_softmax in float64, not the rounded lse minus x_c.
    x, p = huge_logits((5, 9), "prob", dtype, scale)
    x, p = x.to(device), p.to(device).requires_grad_()
    kw = dict(reduction="none", label_smoothing=0.1)
    g = torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    (ours,) = torch.autograd.grad(ops.label_smoothing_cross_entropy(x, p, **kw), p, g.to(dtype))
    p64 = p.detach().double().requires_grad_()
    (oracle,) = torch.autograd.grad(F.cross_entropy(x.double(), p64, **kw), p64, g)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.double(), oracle, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_block_of_a_long_row(device):
    # A long row is cut into parts: a part whose logits are all -∞ must add nothing, not NaN.
    x = torch.randn(1, 16384, device=device, dtype=torch.float64)
    x[:, 4096:12288] = float("-inf")
    t = torch.tensor([5], device=device)
    x.requires_grad_()
    ours = ops.label_smoothing_cross_entropy(x, t, label_smoothing=0.0)
    theirs = F.cross_entropy(x, t)
    assert_close(ours, theirs)
    assert_close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [16384, 40000])  # the CPU's serial sum, and the tensor reduction
def test_sum_of_many_positions_is_exact(device, n):
    # n losses summed: one of 20,000 beside many of about log(100); a sequential float32 sum
    # loses the small ones (relative error 7e-4 at n = 16,384).
    x = torch.full((n, 100), 8.0, device=device)
    t = torch.zeros(n, dtype=torch.long, device=device)
    x[0, 0] = -20000.0
    for reduction in ("sum", "mean"):
        ours = ops.label_smoothing_cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
        oracle = F.cross_entropy(x.double(), t, reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(ours.double(), oracle, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_long_rows_and_few_rows(device):
    # N = 1 splits the row across threads; the parts must combine exactly.
    x, t, w = make_case((1, 100_003), "index", torch.float64, device, ignore=False)
    x.requires_grad_()
    kw = dict(weight=w, label_smoothing=0.1)
    a = ops.label_smoothing_cross_entropy(x, t, **kw)
    b = F.cross_entropy(x, t, **kw)
    assert_close(a, b)
    assert_close(torch.autograd.grad(a, x)[0], torch.autograd.grad(b, x)[0])


def test_int32_targets():
    x, t, _ = make_case((6, 11), "index", torch.float64)
    assert_close(ops.label_smoothing_cross_entropy(x, t.int()), F.cross_entropy(x, t, label_smoothing=0.1))


@pytest.mark.parametrize("device", DEVICES)
def test_probability_target_gradient(device):
    x, p, w = make_case((4, 6), "prob", torch.float64, device)
    x.requires_grad_()
    p.requires_grad_()
    for red in ("mean", "none"):
        a = ops.label_smoothing_cross_entropy(x, p, weight=w, reduction=red, label_smoothing=0.2)
        b = F.cross_entropy(x, p, weight=w, reduction=red, label_smoothing=0.2)
        g = torch.randn_like(b)
        for ga, gb in zip(torch.autograd.grad(a, (x, p), g), torch.autograd.grad(b, (x, p), g), strict=False):
            assert_close(ga, gb)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,kind", FORMS)
@pytest.mark.parametrize("exclude_target", [False, True])
def test_gradcheck(device, shape, kind, exclude_target):
    x, t, w = make_case(shape, kind, torch.float64, device)
    x.requires_grad_()
    if kind == "prob":
        t.requires_grad_()
    inputs = (x, t)

    def fn(x, t):
        return ops.label_smoothing_cross_entropy(
            x, t, weight=w, reduction="none", label_smoothing=0.3, exclude_target=exclude_target
        )

    check_gradcheck(fn, inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,kind", [((5, 7), "index"), ((3, 6, 4), "index"), ((5, 7), "prob")])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck(device, shape, kind, reduction):
    x, t, w = make_case(shape, kind, torch.float64, device)
    x.requires_grad_()
    args = (x, t, w, -100, reduction, 0.1, False)
    check_opcheck(OP, args)
    loss, lse, total = OP(*args)
    # The backward op is not differentiable itself: opcheck it on inputs that need no grad.
    check_opcheck(
        BACKWARD, (torch.ones_like(loss), x.detach(), t, w, lse.detach(), total.detach(), -100, reduction, 0.1, False)
    )


def _smoothed_loss(x, t, w):
    return ops.label_smoothing_cross_entropy(x, t, weight=w, label_smoothing=0.1, reduction="none")


@pytest.mark.parametrize("device", DEVICES)
def test_compile(device):
    for shape in ((4, 10), (7, 13), (2, 5, 3)):  # later shapes go through the dynamic graph
        x, t, w = make_case(shape, "index", torch.float32, device)
        check_compile(_smoothed_loss, x.requires_grad_(), t, w)


@pytest.mark.bad_input
def test_backward_checks_its_inputs():
    x, t = torch.randn(64, 5), torch.randint(5, (64,))
    _, lse, total = OP(x, t, None, -100, "mean", 0.1, False)
    args = dict(grad=torch.ones(()), lse=lse, total_weight=total)

    def backward(reduction="mean", **changes):
        a = {**args, **changes}
        return BACKWARD(a["grad"], x, t, None, a["lse"], a["total_weight"], -100, reduction, 0.1, False)

    with pytest.raises(ValueError, match=r"backward: lse must be \[64\] of Double, got \[1\] of Float"):
        backward(lse=torch.zeros(1))
    with pytest.raises(ValueError, match=r"backward: lse must be \[64\] of Double, got \[64\] of Float"):
        backward(lse=lse.float())
    with pytest.raises(ValueError, match=r"backward: total_weight must be 0-d of Float, got \[1\] of Float"):
        backward(total_weight=total.reshape(1))
    with pytest.raises(ValueError, match=r"backward: grad must have the loss's shape \[\], got \[64\]"):
        backward(grad=torch.ones(64))
    with pytest.raises(ValueError, match=r"backward: grad must have the loss's shape \[64\], got \[\]"):
        backward(reduction="none")
    with pytest.raises(TypeError, match=r"grad must be float32, float64, float16 or bfloat16, got Long"):
        backward(grad=torch.ones((), dtype=torch.long))
    with pytest.raises(ValueError, match=r"input and lse must be on the same device, got cpu and meta"):
        backward(lse=lse.to("meta"))


@pytest.mark.bad_input
def test_raw_op_refuses_a_weight_that_requires_grad():
    w = torch.ones(5, requires_grad=True)
    x, t = torch.randn(4, 5), torch.randint(5, (4,))
    with pytest.raises(ValueError, match=r"weight must not require grad"):
        OP(x, t, w, -100, "mean", 0.1, False)
    with torch.no_grad():  # no gradient is asked for: fine, as in the Python function
        assert_close(OP(x, t, w, -100, "mean", 0.1, False)[0], F.cross_entropy(x, t, weight=w, label_smoothing=0.1))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_narrow_integer_targets_like_f_cross_entropy(dtype):
    x, t = torch.randn(6, 5, dtype=torch.float64), torch.randint(5, (6,))
    ours = ops.label_smoothing_cross_entropy(x, t.to(dtype), reduction="none")
    assert_close(ours, F.cross_entropy(x, t, reduction="none", label_smoothing=0.1))


@pytest.mark.bad_input
@pytest.mark.parametrize("device_of", ["target", "weight"])
def test_meta_tensor_mixed_in_is_a_device_error(device_of):
    args = dict(target=torch.randint(5, (4,)), weight=torch.ones(5))
    args[device_of] = args[device_of].to("meta")
    with pytest.raises(ValueError, match=rf"input and {device_of} must be on the same device, got cpu and meta"):
        OP(torch.randn(4, 5), args["target"], args["weight"], -100, "mean", 0.1, False)


def test_double_backward_is_a_clear_error():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(ops.label_smoothing_cross_entropy(x, torch.tensor([0, 1, 2])), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 6),
    c=st.integers(1, 40),
    extra=st.lists(st.integers(1, 4), max_size=2),
    eps=st.floats(0, 1),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    prob=st.booleans(),
    exclude=st.booleans(),
)
def test_hypothesis_shapes(n, c, extra, eps, reduction, prob, exclude):
    if exclude and c == 1:
        eps = 0.0
    shape = (n, c, *extra)
    x, t, w = make_case(shape, "prob" if prob else "index", torch.float64, seed=n * 1000 + c)
    kw = dict(weight=w, reduction=reduction, label_smoothing=eps, exclude_target=exclude)
    ours = ops.label_smoothing_cross_entropy(x, t, **kw)
    torch.testing.assert_close(ours, reference.label_smoothing_cross_entropy(x, t, **kw), equal_nan=True)
    if not exclude:
        torch.testing.assert_close(
            ours, F.cross_entropy(x, t, weight=w, reduction=reduction, label_smoothing=eps), equal_nan=True
        )


# Each bad input: (input, target, kwargs, exception, message).
x57 = torch.randn(5, 7)
t5 = torch.randint(7, (5,))
BAD = [
    (
        x57,
        torch.tensor([0, 1, 2, 3, 7]),
        {},
        IndexError,
        r"target must hold class indices in \[0, 7\) or ignore_index=-100, got 7",
    ),
    (x57, torch.tensor([0, 1, 2, 3, -1]), {}, IndexError, r"got -1"),
    (x57, torch.randint(7, (4,)), {}, ValueError, r"class-index target must have shape \[5\].*got \[4\]"),
    (x57, torch.rand(5, 6), {}, ValueError, r"floating target .* must have the input's shape \[5, 7\], got \[5, 6\]"),
    (x57, torch.randint(7, (5, 7)), {}, ValueError, r"class-index target must have shape \[5\] .* got \[5, 7\]"),
    (x57, t5, dict(weight=torch.ones(6)), ValueError, r"weight must have shape \(C,\) = \(7,\), got \[6\]"),
    (x57, t5, dict(weight=torch.ones(7, dtype=torch.float64)), TypeError, r"input and weight must have the same dtype"),
    (x57, t5, dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
    (x57, t5, dict(label_smoothing=-0.1), ValueError, r"label_smoothing must be in \[0, 1\], got -0.1"),
    (x57, t5, dict(reduction="avg"), ValueError, r"reduction must be 'none', 'mean' or 'sum', got 'avg'"),
    (torch.randint(5, (5, 7)), t5, {}, TypeError, r"input must be float32, float64, float16 or bfloat16, got Long"),
    (torch.randn(5, 7, dtype=torch.complex64), t5, {}, TypeError, r"input must be float32.*got ComplexFloat"),
    (torch.randn(5, 0), t5, {}, ValueError, r"input must have at least one class \(C > 0\)"),
    (x57, t5.to(torch.bool), {}, TypeError, r"target must hold class indices \(int64 or int32\).*got Bool"),
    (
        x57,
        torch.rand(5, 7),
        dict(ignore_index=2),
        ValueError,
        r"ignore_index is not supported with probability targets",
    ),
    (
        x57,
        torch.rand(5, 7, dtype=torch.float64),
        {},
        TypeError,
        r"input and a probability target must have the same dtype",
    ),
    (
        torch.randn(5, 1),
        torch.zeros(5, dtype=torch.long),
        dict(exclude_target=True),
        ValueError,
        r"needs C >= 2, got C = 1",
    ),
    (torch.tensor(1.0), torch.tensor(0), {}, ValueError, r"input must have shape \(C\), \(N, C\)"),
    (x57, t5, dict(weight=torch.ones(7, requires_grad=True)), ValueError, r"weight must not require grad"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("x,t,kw,exc,match", BAD)
def test_bad_input(x, t, kw, exc, match):
    with pytest.raises(exc, match=match):
        ops.label_smoothing_cross_entropy(x, t, **kw)


@pytest.mark.bad_input
@pytest.mark.parametrize("x,t,kw,exc,match", BAD)
def test_bad_input_under_compile(monkeypatch, x, t, kw, exc, match):
    check_compiled_refuses_like_eager(
        monkeypatch, ["label_smoothing_cross_entropy"], lambda: ops.label_smoothing_cross_entropy(x, t, **kw)
    )


@pytest.mark.bad_input
@pytest.mark.parametrize("x,t,kw,exc,match", [case for case in BAD if case[3] is not IndexError])
def test_bad_input_on_meta_tensors(monkeypatch, x, t, kw, exc, match):
    """The fake kernel refuses what the kernel refuses; only class indices out of range (the
    IndexErrors) are the kernel's alone: on meta tensors there are no values to read."""
    check_meta_refuses_like_eager(
        monkeypatch, "label_smoothing_cross_entropy", lambda: ops.label_smoothing_cross_entropy(x, t, **kw)
    )


@pytest.mark.bad_input
@pytest.mark.cuda
def test_device_mismatch():
    with pytest.raises(ValueError, match=r"input and target must be on the same device"):
        ops.label_smoothing_cross_entropy(x57.cuda(), t5)


def test_module():
    w = torch.rand(7)
    m = torchkit.nn.LabelSmoothingCrossEntropy(weight=w, label_smoothing=0.2, reduction="sum")
    assert "label_smoothing=0.2" in repr(m) and "reduction='sum'" in repr(m) and "weighted=True" in repr(m)
    assert "weight" in m.state_dict()
    assert_close(m(x57, t5), F.cross_entropy(x57, t5, weight=w, label_smoothing=0.2, reduction="sum"))
    excl = torchkit.nn.LabelSmoothingCrossEntropy(exclude_target=True)
    assert "exclude_target=True" in repr(excl)
    assert_close(excl(x57, t5), reference.label_smoothing_cross_entropy(x57, t5, exclude_target=True))


def test_module_signature_like_cross_entropy_loss():
    with pytest.raises(
        TypeError, match=r"weight \(the first positional argument.*got float 0.1; .*label_smoothing=0.1"
    ):
        torchkit.nn.LabelSmoothingCrossEntropy(0.1)
    timm_style = torchkit.nn.LabelSmoothingCrossEntropy(smoothing=0.3)
    assert timm_style.label_smoothing == 0.3
    assert_close(timm_style(x57, t5), F.cross_entropy(x57, t5, label_smoothing=0.3))
    assert torchkit.nn.LabelSmoothingCrossEntropy().label_smoothing == 0.1
    with pytest.raises(ValueError, match="smoothing is an alias of label_smoothing"):
        torchkit.nn.LabelSmoothingCrossEntropy(label_smoothing=0.1, smoothing=0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_runs_the_loss_in_float32_like_f_cross_entropy(dtype):
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    t = torch.randint(1000, (64,), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = ops.label_smoothing_cross_entropy(x, t)
        theirs = F.cross_entropy(x, t, label_smoothing=0.1)
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    assert x.grad.dtype == dtype


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_64bit_indexing_past_2_31_elements(device):
    # 2¹¹ rows × 2²⁰ + 1 classes: flat offsets pass 2³¹ (PyTorch #111484). bfloat16 keeps it at 4 GiB.
    n, c = 2048, (1 << 20) + 1
    x = torch.zeros(n, c, dtype=torch.bfloat16, device=device)
    t = torch.arange(n, device=device) * 511 % c
    x[torch.arange(n, device=device), t] = 5.0
    loss = ops.label_smoothing_cross_entropy(x, t, reduction="none", label_smoothing=0.0)
    lse = torch.log(torch.tensor(c - 1 + torch.e**5, dtype=torch.float64))
    torch.testing.assert_close(loss[-1].double().cpu(), lse - 5, rtol=1e-2, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "shape,kind", [((300, 5000), "index"), ((3, 6, 4, 5), "index"), ((64, 100), "prob"), ((2, 9, 33), "prob")]
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_matches_cpu(dtype, shape, kind, reduction):
    x, t, w = make_case(shape, kind, dtype)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)

    def loss(x, t, w):
        return ops.label_smoothing_cross_entropy(x, t, weight=w, reduction=reduction, label_smoothing=0.1)

    check_cuda_matches_cpu(loss, x, t, w, differentiable=(0, 1) if kind == "prob" else (0,), **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(5, 7), (3, 7, 4)])
def test_cuda_out_of_range_target_is_a_device_side_assert(shape):
    # On CUDA the range check runs in the kernel (a host-side check would synchronise every call).
    code = f"""
import torch, torchkit
x = torch.randn({shape}, device="cuda")
t = torch.zeros({(shape[0], *shape[2:])}, dtype=torch.long, device="cuda")
t.view(-1)[-1] = 7
try:
    torchkit.ops.label_smoothing_cross_entropy(x, t, reduction="none")
    torch.cuda.synchronize()
except RuntimeError as e:
    print("raised:", e)
"""
    assert_device_side_assert(code, "target must hold class indices")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e38), (torch.bfloat16, 1e38), (torch.float16, 3e4)])
@pytest.mark.parametrize("n", [10, 20000])  # the CPU's serial sum (up to 16,384 positions) and the tensor sum
def test_a_sum_of_finite_losses_that_overflows_is_inf(device, dtype, scale, n):
    """As F.cross_entropy: each loss is finite, their sum passes the dtype's range and is inf;
    the mean stays finite. It raised 'value cannot be converted to type float without overflow'."""
    x = torch.zeros(n, 2, dtype=dtype, device=device)
    x[:, 0] = -scale
    target = torch.zeros(n, dtype=torch.long, device=device)
    losses = ops.label_smoothing_cross_entropy(x, target, reduction="none")
    assert losses.isfinite().all()
    total = ops.label_smoothing_cross_entropy(x, target, reduction="sum")
    assert total.dtype == dtype and total.item() == float("inf")
    assert F.cross_entropy(x, target, reduction="sum", label_smoothing=0.1).item() == float("inf")
    mean = ops.label_smoothing_cross_entropy(x, target, reduction="mean")
    torch.testing.assert_close(mean, F.cross_entropy(x.double(), target, label_smoothing=0.1).to(dtype))
