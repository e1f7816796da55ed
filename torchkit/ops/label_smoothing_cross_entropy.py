"""label_smoothing_cross_entropy: the Python function, its fake kernels and its autograd formula."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from torchkit.ops._common import (
    acc_dtype,
    as_float,
    as_int,
    check_bool,
    check_floating,
    check_same_device,
    check_scalars,
    check_tensor,
    describe,
    dtype_name,
    register_op,
)


def label_smoothing_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.1,
    *,
    exclude_target: bool = False,
) -> Tensor:
    """Cross-entropy with label smoothing, fused: one pass forward, one pass backward.

    With ``exclude_target=False`` this is ``F.cross_entropy(input, target, weight=weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)`` for
    every form PyTorch accepts, gradients included, without materialising ``log_softmax``.

    Args:
        input (Tensor[C], Tensor[N, C] or Tensor[N, C, d1, ..., dk]): logits, float32,
            float64, float16 or bfloat16 (reduced types accumulate in float32).
        target: class indices (int64 or int32; uint8, int8 and int16 are widened to int64,
            as F.cross_entropy takes them too) of shape ``()``, ``(N,)`` or
            ``(N, d1, ..., dk)``, or class probabilities with ``input``'s shape and dtype.
        weight (Tensor[C], optional): per-class weights, a constant (no gradient).
        ignore_index: positions whose index target equals it add nothing, to the loss or
            to the mean's denominator. Not allowed (>= 0) with probability targets.
        reduction: ``"none"`` (one loss per position), ``"mean"`` (the sum divided by the
            total weight of the kept positions, or by their number for probability
            targets) or ``"sum"``.
        label_smoothing: ε in [0, 1].
        exclude_target: the smoothing convention. ``False`` (PyTorch's): the target
            distribution is ``(1 - ε)·y + ε/C``, the target class included in the uniform
            part. ``True`` (the cookbook's): the target class gets ``1 - ε`` and each of the
            other ``C - 1`` classes ``ε/(C - 1)``; for a probability target ``p`` the
            distribution is ``(1 - ε)·p + ε·(1 - p)/(C - 1)``, which is the same for a
            one-hot ``p``. Weights, ``ignore_index`` and the reductions apply exactly as for
            ``False``: class ``c``'s term ``-q_c·log softmax_c`` is scaled by ``weight[c]``
            and ``"mean"`` divides by the summed ``weight[target]`` of kept positions.
            Needs ``C >= 2`` when ``ε > 0``.

    Returns:
        The loss: a scalar for ``"mean"`` and ``"sum"``, the positions' shape for
        ``"none"``; ``input``'s dtype.

    Example::

        >>> logits = torch.randn(8, 1000, requires_grad=True)
        >>> labels = torch.randint(1000, (8,))
        >>> loss = torchkit.ops.label_smoothing_cross_entropy(logits, labels, label_smoothing=0.1)
        >>> loss.backward()
    """
    op = "label_smoothing_cross_entropy"
    check_tensor(op, "input", input)
    check_tensor(op, "target", target)
    check_tensor(op, "weight", weight, optional=True)
    ignore_index = as_int(op, "ignore_index", ignore_index)
    check_reduction(op, reduction)
    label_smoothing = as_float(op, "label_smoothing", label_smoothing)
    check_bool(op, "exclude_target", exclude_target)
    # Checked here too, not only by the kernels and the fake kernel: torch.compile then raises
    # eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
    if target.dtype in (torch.uint8, torch.int8, torch.int16):
        target = target.long()
    _check_inputs(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target)
    _check_weight_constant(weight)
    loss, _, _ = _forward_op(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target)
    return loss


def check_reduction(op: str, reduction: Any) -> None:
    """reduction's type; its value is the kernel's check (csrc/label_smoothing_cross_entropy.cpp)."""
    if not isinstance(reduction, str):
        raise TypeError(f"{op}: reduction must be 'none', 'mean' or 'sum', got {describe(reduction)}")


def _positions(input: Tensor) -> tuple:
    return () if input.dim() == 1 else (input.shape[0], *input.shape[2:])


def _check_scalars(ignore_index: Any, label_smoothing: Any, exclude_target: Any) -> None:
    """The raw op's Scalar arguments as its kernels read them (the fake kernels' part)."""
    check_scalars(
        "label_smoothing_cross_entropy",
        ("int", "ignore_index", ignore_index),
        ("float", "label_smoothing", label_smoothing),
        ("bool", "exclude_target", exclude_target),
    )


def _check_inputs(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    exclude_target: bool,
) -> None:
    """csrc/label_smoothing_cross_entropy.cpp's check_inputs, in the same order with the same
    messages, for the Python function and the fake kernel: meta tensors and torch.compile
    refuse bad input as the kernels do. Only the target's values (class indices in range)
    are the kernels' alone: no shape or dtype says them."""
    op = "label_smoothing_cross_entropy"
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{op}: reduction must be 'none', 'mean' or 'sum', got '{reduction}'")
    check_floating(op, "input", input)
    if input.dim() == 0:
        raise ValueError(f"{op}: input must have shape (C), (N, C) or (N, C, d1, ..., dk), got a 0-d tensor")
    check_same_device(op, input=input, target=target)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing:g}")  # as C++ prints it
    C = input.shape[0 if input.dim() == 1 else 1]
    if C == 0:
        raise ValueError(f"{op}: input must have at least one class (C > 0), got input of shape {list(input.shape)}")
    if target.is_floating_point():
        if target.shape != input.shape:
            raise ValueError(
                f"{op}: a floating target holds class probabilities and must have the input's shape "
                f"{list(input.shape)}, got {list(target.shape)}"
            )
        if target.dtype != input.dtype:
            raise TypeError(
                f"{op}: input and a probability target must have the same dtype, got {dtype_name(input.dtype)} and "
                f"{dtype_name(target.dtype)}"
            )
        if ignore_index >= 0:
            raise ValueError(
                f"{op}: ignore_index is not supported with probability targets, got ignore_index={ignore_index}"
            )
    else:
        if target.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"{op}: target must hold class indices (int64 or int32) or class probabilities (the input's floating "
                f"dtype), got {dtype_name(target.dtype)}"
            )
        positions = list(_positions(input))
        if list(target.shape) != positions:
            raise ValueError(
                f"{op}: a class-index target must have shape {positions} (the input's shape {list(input.shape)} "
                f"without the class dimension), got {list(target.shape)}"
            )
    if weight is not None:
        if weight.dim() != 1 or weight.shape[0] != C:
            raise ValueError(f"{op}: weight must have shape (C,) = ({C},), got {list(weight.shape)}")
        if weight.dtype != input.dtype:
            raise TypeError(
                f"{op}: input and weight must have the same dtype, got {dtype_name(input.dtype)} and "
                f"{dtype_name(weight.dtype)}"
            )
        check_same_device(op, input=input, weight=weight)
    if exclude_target and C < 2 and label_smoothing != 0.0:
        raise ValueError(
            f"{op}: exclude_target=True spreads label_smoothing over the C - 1 other classes and needs C >= 2, "
            f"got C = {C}"
        )


def _check_weight_constant(weight: Optional[Tensor]) -> None:
    """The backward gives weight no gradient: one that asks for it would silently get none."""
    if weight is not None and weight.requires_grad:
        raise ValueError(
            "label_smoothing_cross_entropy: weight must not require grad (class weights are "
            "constants here), got a weight with requires_grad=True; pass weight.detach()"
        )


@torch.library.register_fake("torchkit::label_smoothing_cross_entropy")
def _(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target):
    _check_scalars(ignore_index, label_smoothing, exclude_target)
    _check_inputs(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target)
    positions = _positions(input)
    acc = acc_dtype(input)
    loss = input.new_empty(positions if reduction == "none" else ())
    # lse is float64 for every input dtype: the backward splits it into hi + lo
    # (csrc/label_smoothing_cross_entropy.h, split_lse) to stay exact at any shift of the logits.
    lse = input.new_empty(positions, dtype=torch.float64)
    return loss, lse, input.new_empty((), dtype=acc)


@torch.library.register_fake("torchkit::_label_smoothing_cross_entropy_backward")
def _(grad, input, target, weight, lse, total_weight, ignore_index, reduction, label_smoothing, exclude_target):
    _check_scalars(ignore_index, label_smoothing, exclude_target)
    check_same_device(
        "label_smoothing_cross_entropy",
        input=input,
        target=target,
        weight=weight,
        grad=grad,
        lse=lse,
        total_weight=total_weight,
    )
    return torch.empty_like(input, memory_format=torch.contiguous_format)


# The autograd formula. Eager autograd and torch.compile use its C++ form
# (csrc/label_smoothing_cross_entropy.cpp, the op's Autograd kernel: no Python per call); this one serves
# the torch.func transforms and forward-mode AD.
def _setup_context(ctx, inputs, output):
    input, target, weight, ignore_index, reduction, label_smoothing, exclude_target = inputs
    _check_weight_constant(weight)  # the raw op refuses it too
    _, lse, total_weight = output
    # Only the inputs (no copies), per-position lse and the mean's denominator.
    ctx.save_for_backward(input, target, weight, lse, total_weight)
    ctx.save_for_forward(input, target, weight, lse, total_weight)  # for _jvp
    ctx.mark_non_differentiable(lse, total_weight)  # what the backward needs, not results
    ctx.args = (ignore_index, reduction, label_smoothing, exclude_target)


def _target_grad(ctx, grad, input, weight, total_weight) -> Tensor:
    """Probability targets only: ∂ℓ/∂p_c = a·w_c·(lse - x_c), a the target coefficient, times
    the upstream gradient. lse - x_c = -log_softmax in float64, exact at any magnitude of the
    logits (the saved lse minus x_c would round at it, and lose log Σ past 2⁵³)."""
    _, reduction, label_smoothing, exclude_target = ctx.args
    class_dim = 0 if input.dim() == 1 else 1
    C = input.shape[class_dim]
    eps = label_smoothing
    a = 1 - eps - (eps / (C - 1) if exclude_target and C > 1 else 0.0)
    scale = grad / total_weight if reduction == "mean" else grad
    scale = scale.double().unsqueeze(class_dim) if reduction == "none" else scale.double()
    view = [1] * input.dim()
    view[class_dim] = C
    w = 1.0 if weight is None else weight.double().view(view)
    return scale * a * w * -torch.log_softmax(input.double(), class_dim)


def _backward(ctx, grad, _grad_lse, _grad_total_weight):
    input, target, weight, lse, total_weight = ctx.saved_tensors
    grad_input = grad_target = None
    if ctx.needs_input_grad[0]:
        grad_input = _backward_op(grad, input, target, weight, lse, total_weight, *ctx.args)
    if ctx.needs_input_grad[1]:
        grad_target = _target_grad(ctx, grad, input, weight, total_weight).to(target.dtype)
    return grad_input, grad_target, None, None, None, None, None


def _jvp(ctx, input_tangent, target_tangent, *_):
    """The loss's tangent: its gradient (the backward kernel with a unit upstream gradient)
    dotted with the tangents, per position for reduction="none"."""
    input, target, weight, lse, total_weight = ctx.saved_tensors
    reduction = ctx.args[1]
    class_dim = 0 if input.dim() == 1 else 1
    unit = input.new_ones(lse.shape if reduction == "none" else ())
    dims = (class_dim,) if reduction == "none" else tuple(range(input.dim()))
    tangent = None
    if input_tangent is not None:
        g = _backward_op(unit, input, target, weight, lse, total_weight, *ctx.args)
        tangent = (g.to(lse.dtype) * input_tangent.to(lse.dtype)).sum(dims)
    if target_tangent is not None:
        t = (_target_grad(ctx, unit, input, weight, total_weight) * target_tangent.double()).sum(dims)
        tangent = t if tangent is None else tangent + t
    return (None if tangent is None else tangent.to(input.dtype)), None, None


# Under autocast: a loss, as autocast runs F.cross_entropy: the logits and the result in float32.
_forward_op, _backward_op = register_op(
    "label_smoothing_cross_entropy", _setup_context, _backward, jvp=_jvp, autocast_to=torch.float32
)
