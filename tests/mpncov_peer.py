"""A covariance-pooling layer with fast-MPN-COV's structure (Li et al., CVPR 2018,
jiangtaoxie/fast-MPN-COV ``MPNCOV``), written from the published algorithm for the tests
and benchmarks to compare torchkit.ops.covariance_pool against.

Its structure, which is what the comparison is about: the covariance as ``X·Î·Xᵀ`` with the
M×M centring matrix ``Î = (1/M)(I - (1/M)·11ᵀ)`` built (and kept for backward) per sample;
the square root's iterates all kept; the analytic backward of the paper (Covpool: ``(G +
Gᵀ)·X·Î``; Sqrtm: the Newton–Schulz adjoints, then the trace's terms); the upper triangle
through an index. It computes in the input's dtype throughout (float64 in the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor


class _Covpool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        N, D, M = x.shape[0], x.shape[1], x[0, 0].numel()
        X = x.reshape(N, D, M)
        eye = torch.eye(M, dtype=x.dtype, device=x.device)
        I_hat = ((eye - 1.0 / M) / M).expand(N, M, M).contiguous()
        ctx.save_for_backward(x, I_hat)
        return X.bmm(I_hat).bmm(X.mT)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        x, I_hat = ctx.saved_tensors
        X = x.reshape(x.shape[0], x.shape[1], -1)
        return (grad + grad.mT).bmm(X).bmm(I_hat).reshape(x.shape)


class _Sqrtm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sigma: Tensor, iterations: int) -> Tensor:
        N, D = sigma.shape[0], sigma.shape[1]
        I3 = 3 * torch.eye(D, dtype=sigma.dtype, device=sigma.device).expand(N, D, D)
        tr = sigma.diagonal(dim1=1, dim2=2).sum(1).view(N, 1, 1)
        A = sigma / tr
        Y = sigma.new_zeros(N, max(iterations - 1, 1), D, D)
        Z = sigma.new_zeros(N, max(iterations - 1, 1), D, D)
        T = 0.5 * (I3 - A)
        Y[:, 0], Z[:, 0] = A.bmm(T), T
        for i in range(1, iterations - 1):
            T = 0.5 * (I3 - Z[:, i - 1].bmm(Y[:, i - 1]))
            Y[:, i], Z[:, i] = Y[:, i - 1].bmm(T), T.bmm(Z[:, i - 1])
        last = iterations - 2
        F = Y[:, 0] if iterations == 1 else 0.5 * Y[:, last].bmm(I3 - Z[:, last].bmm(Y[:, last]))
        ctx.save_for_backward(sigma, A, F, tr, Y, Z)
        ctx.iterations = iterations
        return F * tr.sqrt()

    @staticmethod
    def backward(ctx, grad: Tensor):
        sigma, A, F, tr, Y, Z = ctx.saved_tensors
        n = ctx.iterations
        D = sigma.shape[1]
        I3 = 3 * torch.eye(D, dtype=sigma.dtype, device=sigma.device).expand_as(sigma)
        gF = grad * tr.sqrt()  # through the post-compensation F·√tr
        g_tr_post = (grad * F).sum((1, 2)).view(-1, 1, 1) / (2 * tr.sqrt())
        if n == 1:
            gA = 0.5 * (gF.bmm(I3 - A) - A.bmm(gF))
        else:
            Yl, Zl = Y[:, n - 2], Z[:, n - 2]
            gY = 0.5 * (gF.bmm(I3 - Yl.bmm(Zl)) - Zl.bmm(Yl).bmm(gF))
            gZ = -0.5 * Yl.bmm(gF).bmm(Yl)
            for i in range(n - 3, -1, -1):
                Yi, Zi = Y[:, i], Z[:, i]
                YZ = I3 - Yi.bmm(Zi)
                ZY = Zi.bmm(Yi)
                gY, gZ = (
                    0.5 * (gY.bmm(YZ) - Zi.bmm(gZ).bmm(Zi) - ZY.bmm(gY)),
                    0.5 * (YZ.bmm(gZ) - Yi.bmm(gY).bmm(Yi) - gZ.bmm(ZY)),
                )
            gA = 0.5 * (gY.bmm(I3 - A) - gZ - A.bmm(gY))
        # A = Σ / tr: gA / tr, and tr's terms (the post-compensation's and the division's).
        g_tr = g_tr_post - (gA * sigma).sum((1, 2)).view(-1, 1, 1) / tr**2
        return gA / tr + g_tr * torch.eye(D, dtype=sigma.dtype, device=sigma.device), None


class _Triuvec(torch.autograd.Function):
    @staticmethod
    def forward(ctx, m: Tensor) -> Tensor:
        D = m.shape[1]
        index = torch.ones(D, D, dtype=torch.bool, device=m.device).triu().flatten().nonzero().squeeze(1)
        ctx.save_for_backward(index)
        ctx.D = D
        return m.reshape(m.shape[0], D * D)[:, index]

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(grad.shape[0], ctx.D * ctx.D)
        out[:, index] = grad
        return out.view(grad.shape[0], ctx.D, ctx.D)


def mpncov(x: Tensor, *, iterations: int = 5, sqrt: bool = True, triu: bool = True) -> Tensor:
    """``covariance_pool``'s semantics with fast-MPN-COV's structure (see the module)."""
    out = _Covpool.apply(x)
    if sqrt:
        out = _Sqrtm.apply(out, iterations)
    return _Triuvec.apply(out) if triu else out
