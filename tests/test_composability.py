"""torch.func transforms, forward-mode AD and torch.export over every op: reverse mode (grad, jacrev,
per-sample gradients with vmap) works; forward mode works where the op has a formula
(cross-entropy, permute_blocks) and is refused by name where it has none, never a silent zero."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.autograd.functional import jacobian
from torch.autograd.functional import jvp as autograd_jvp

import torchkit
from torchkit import ops, reference

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


_Y = _x(4, 5, seed=1)
# Index tensors made outside the transforms: made inside, older torch lifts them into the
# transform too, and the reference's .tolist() of a lifted tensor fails.
_TARGET = torch.tensor([0, 2, 1, 4, 3, 0])
_PERMUTATION = torch.tensor([[3, 1, 0, 2], [0, 2, 3, 1]])
CASES = {
    "cdist": (lambda a: ops.cdist(a, _Y), lambda a: reference.cdist(a, _Y), (6, 5)),
    "bilinear_pool": (ops.bilinear_pool, reference.bilinear_pool, (2, 3, 4, 4)),
    "covariance_pool": (ops.covariance_pool, reference.covariance_pool, (2, 3, 4, 4)),
    "knn": (lambda a: ops.knn(a, _Y, 3)[0], lambda a: reference.knn(a, _Y, 3)[0], (6, 5)),
    "label_smoothing_cross_entropy": (
        lambda a: ops.label_smoothing_cross_entropy(a, _TARGET),
        lambda a: F.cross_entropy(a, _TARGET, label_smoothing=0.1),
        (6, 5),
    ),
    "permute_blocks": (
        lambda a: ops.permute_blocks(a, _PERMUTATION, 2),
        lambda a: reference.permute_blocks(a, _PERMUTATION, 2),
        (2, 3, 4, 4),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_func_grad_and_jacrev(name):
    op, ref, shape = CASES[name]
    x = _x(*shape)
    # The references' derivatives by plain autograd: the block shuffle's reference reads its
    # permutation with .tolist(), which torch.func refuses in older releases (torch 2.8).
    torch.testing.assert_close(torch.func.grad(lambda a: op(a).sum())(x), jacobian(lambda a: ref(a).sum(), x))
    torch.testing.assert_close(torch.func.jacrev(op)(x), jacobian(ref, x))


@pytest.mark.parametrize("name", ["cdist", "bilinear_pool", "covariance_pool", "knn"])
def test_per_sample_gradients(name):
    op, ref, shape = CASES[name]
    x = _x(*shape)

    def per_sample(f):
        return torch.func.vmap(torch.func.grad(lambda row: f(row.unsqueeze(0)).square().sum()))(x)

    torch.testing.assert_close(per_sample(op), per_sample(ref))


def test_per_sample_gradients_of_the_loss():
    x, t = _x(6, 5), torch.tensor([0, 2, 1, 4, 3, 0])

    def per_sample(loss):
        return torch.func.vmap(torch.func.grad(lambda row, label: loss(row[None], label[None])))(x, t)

    torch.testing.assert_close(
        per_sample(ops.label_smoothing_cross_entropy),
        per_sample(lambda a, b: F.cross_entropy(a, b, label_smoothing=0.1)),
    )


@pytest.mark.parametrize("name", ["label_smoothing_cross_entropy", "permute_blocks"])
def test_forward_mode_where_there_is_a_formula(name):
    op, ref, shape = CASES[name]
    x, tangent = _x(*shape), _x(*shape, seed=2)
    expected = autograd_jvp(ref, x, tangent)[1]
    torch.testing.assert_close(torch.func.jvp(op, (x,), (tangent,))[1], expected)
    torch.testing.assert_close(torch.func.jacfwd(op)(x), jacobian(ref, x))
    with fwAD.dual_level():
        out = op(fwAD.make_dual(x, tangent))
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", ["index", "prob"])
def test_cross_entropy_jvp_matches_f_cross_entropy(reduction, kind):
    x, tx = _x(4, 6, 3), _x(4, 6, 3, seed=1)
    w = _x(6, seed=2).abs() + 0.5
    if kind == "prob":
        t, tt = _x(4, 6, 3, seed=3).softmax(1), _x(4, 6, 3, seed=4)
        primals, tangents = (x, t), (tx, tt)
    else:
        t = torch.randint(6, (4, 3), generator=torch.Generator().manual_seed(3))
        t[0, 0] = -100
        primals, tangents = (x,), (tx,)
    kw = dict(weight=w, reduction=reduction, label_smoothing=0.2)

    def ours(a, b=t):
        return ops.label_smoothing_cross_entropy(a, b, **kw)

    def theirs(a, b=t):
        return F.cross_entropy(a, b, **kw)

    torch.testing.assert_close(torch.func.jvp(ours, primals, tangents)[1], torch.func.jvp(theirs, primals, tangents)[1])


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["cdist", "bilinear_pool", "covariance_pool", "knn"])
def test_forward_mode_without_a_formula_is_refused_by_name(name):
    op, _, shape = CASES[name]
    x = _x(*shape)
    with pytest.raises(NotImplementedError, match=rf"torchkit.ops.{name}: forward-mode AD .* not supported"):
        torch.func.jvp(op, (x,), (torch.ones_like(x),))
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match=rf"torchkit.ops.{name}: forward-mode AD"):
        op(fwAD.make_dual(x, torch.ones_like(x)))


def test_compile_still_traces_the_raw_ops():
    x = _x(6, 5).requires_grad_()
    compiled = torch.compile(lambda a: ops.cdist(a).sum(), fullgraph=True)
    compiled(x).backward()
    expected = torch.func.grad(lambda a: reference.cdist(a).sum())(x.detach())
    torch.testing.assert_close(x.grad, expected)


class _PermuteBlocks(torch.nn.Module):
    def forward(self, x, permutation):
        return ops.permute_blocks(x, permutation, 2)


EXPORTED = {
    "CDist": (lambda: torchkit.nn.CDist(), (_x(6, 5), _Y)),
    "BilinearPool2d": (lambda: torchkit.nn.BilinearPool2d(), (_x(2, 3, 4, 4),)),
    "CovariancePool2d": (lambda: torchkit.nn.CovariancePool2d(), (_x(2, 3, 4, 4),)),
    "LabelSmoothingCrossEntropy": (
        lambda: torchkit.nn.LabelSmoothingCrossEntropy(),
        (_x(6, 5), torch.tensor([0, 2, 1, 4, 3, 0])),
    ),
    "permute_blocks": (_PermuteBlocks, (_x(2, 3, 4, 4), torch.tensor([[3, 1, 0, 2], [0, 2, 3, 1]]))),
}


@pytest.mark.parametrize("name", EXPORTED)
def test_torch_export(name):
    make_module, args = EXPORTED[name]
    module = make_module()
    exported = torch.export.export(module, args)
    torch.testing.assert_close(exported.module()(*args), module(*args))


@pytest.mark.parametrize("name", CASES)
def test_eager_and_function_backward_formulas_agree(name):
    """Eager autograd runs the raw op's own formula (C++ for cdist, bilinear_pool,
    covariance_pool and the cross-entropy; register_autograd for the others); torch.func runs
    the autograd.Function's Python backward. Both must give the same gradient."""
    op, _, shape = CASES[name]
    x = _x(*shape).requires_grad_()
    out = op(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    (eager,) = torch.autograd.grad(out, x, g)
    (function,) = torch.func.vjp(op, x.detach())[1](g)
    torch.testing.assert_close(function, eager, rtol=1e-12, atol=1e-12)


def test_transform_probe():
    """The private-API probe that routes calls to the autograd.Function: off in plain code,
    on under torch.func and inside a forward-AD dual level."""
    from torchkit.ops._common import transform_or_forward_ad_active

    assert not transform_or_forward_ad_active()
    seen = []
    torch.func.grad(lambda a: seen.append(transform_or_forward_ad_active()) or a.sum())(_x(3))
    with fwAD.dual_level():
        seen.append(transform_or_forward_ad_active())
    assert seen == [True, True]
