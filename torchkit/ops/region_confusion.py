"""permute_blocks and region_confusion: the Python functions, the fake kernel, the autograd
formula, and the permutation draws that nn.RegionConfusion and the v2 transform share."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchkit.ops._common import as_int, check_same_device, check_scalars, check_tensor, dtype_name, register_op


def permute_blocks(x: Tensor, permutation: Tensor, num_blocks: int) -> Tensor:
    """Rearrange an image's ``num_blocks × num_blocks`` grid of blocks: output block ``b`` is
    input block ``permutation[..., b]`` (blocks numbered row-major). One pass, one read per
    output element; any dtype (uint8 and bool included), contiguous or ``channels_last``
    (kept in the output). Differentiable: the gradient is the gather by the inverse, so the
    backward refuses a ``permutation`` that repeats a block index (the forward copies
    repeated blocks as asked).

    Args:
        x (Tensor[C, H, W] or Tensor[N, C, H, W]): blocks are ``⌊H/n⌋ × ⌊W/n⌋``; rows below
            and columns right of the last full block stay in place.
        permutation (Tensor[n²] or Tensor[N, n²]): int64 or int32 block indices in
            ``[0, n²)`` (values out of range raise on the CPU and fail a device-side
            assertion on CUDA). The forward is a gather and takes any such index map: a
            repeated index copies its block to each place that names it, unchecked (a check
            would synchronise with the GPU). The gradient needs a permutation per sample.
        num_blocks: ``n``, in ``[1, min(H, W)]``.
    """
    check_tensor("permute_blocks", "x", x)
    check_tensor("permute_blocks", "permutation", permutation)
    num_blocks = as_int("permute_blocks", "num_blocks", num_blocks)
    # Checked here too, not only by the kernels and the fake kernel: torch.compile then raises
    # eager's own exception, where a fake kernel's is wrapped in its TorchRuntimeError.
    _check_inputs(x, permutation, num_blocks)
    return _forward_op(x, permutation, num_blocks)


def _check_inputs(x: Tensor, permutation: Tensor, num_blocks: int) -> None:
    """csrc/region_confusion.cpp's checks (prepare), in the same order with the same messages,
    for the Python function and the fake kernel. The indices' range is the kernels' alone: no
    shape or dtype says it."""
    op = "permute_blocks"
    if x.dim() not in (3, 4):
        raise ValueError(f"{op}: x must be an image (C, H, W) or a batch (N, C, H, W), got shape {list(x.shape)}")
    H, W, n = x.shape[-2], x.shape[-1], num_blocks
    if not (n >= 1 and n <= H and n <= W):
        raise ValueError(
            f"{op}: num_blocks must be in [1, min(H, W)] = [1, {min(H, W)}] for x of shape {list(x.shape)}, got {n}"
        )
    if permutation.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{op}: permutation must hold block indices (int64 or int32), got {dtype_name(permutation.dtype)}"
        )
    check_same_device(op, x=x, permutation=permutation)
    expected = [x.shape[0], n * n] if x.dim() == 4 else [n * n]
    if list(permutation.shape) != expected:
        raise ValueError(
            f"{op}: permutation must have shape {expected} (one index per block, num_blocks² per sample), got "
            f"{list(permutation.shape)}"
        )


def _permute_blocks_format(x: Tensor) -> torch.memory_format:
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    cl = x4.shape[1] > 1 and x4.is_contiguous(memory_format=torch.channels_last) and not x4.is_contiguous()
    return torch.channels_last if cl else torch.contiguous_format


@torch.library.register_fake("torchkit::permute_blocks")
def _(x, permutation, num_blocks):
    check_scalars("permute_blocks", ("int", "num_blocks", num_blocks))
    _check_inputs(x, permutation, num_blocks)
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    out = torch.empty_like(x4, memory_format=_permute_blocks_format(x))
    return out if x.dim() == 4 else out.squeeze(0)


def _inverse_permutation(permutation: Tensor) -> Tensor:
    index = permutation.long()
    # Only a bijection has an inverse; with a repeated index the scatter below would leave
    # entries unwritten. Checked on the device (no synchronisation): a RuntimeError on the
    # CPU, a device-side assertion on CUDA, as for out-of-range values.
    counts = torch.zeros_like(index).scatter_add_(-1, index, torch.ones_like(index))
    torch._assert_async(
        (counts == 1).all(),
        "permute_blocks: the gradient needs a permutation (every block index exactly once per sample)",
    )
    ids = torch.arange(index.shape[-1], device=index.device).expand_as(index)
    return torch.empty_like(index).scatter_(-1, index, ids)


def _setup_context(ctx, inputs, output):
    _, permutation, num_blocks = inputs
    ctx.save_for_backward(permutation)
    ctx.save_for_forward(permutation)
    ctx.num_blocks = num_blocks


def _backward(ctx, grad):
    (permutation,) = ctx.saved_tensors
    # Linear, so its gradient is itself with the inverse permutation (and differentiable again).
    return permute_blocks(grad, _inverse_permutation(permutation), ctx.num_blocks), None, None


def _jvp(ctx, x_tangent, _permutation_tangent, _num_blocks_tangent):
    (permutation,) = ctx.saved_tensors
    return permute_blocks(x_tangent, permutation, ctx.num_blocks)  # linear: the op itself


_forward_op, _ = register_op(
    "permute_blocks", _setup_context, _backward, jvp=_jvp, autograd_in_python=True
)  # a copy: autocast leaves it alone


def _check_probability(name: str, p: float) -> None:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name}: p must be a float in [0, 1], got {type(p).__name__} {p!r}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: p must be a probability in [0, 1], got {p}")


def _check_settings(name: str, num_blocks: int, neighbourhood: int, image_known: bool = False) -> None:
    """The settings every RCM entry point takes, checked where they are given (num_blocks'
    upper bound, min(H, W), once the image is known: _check_args)."""
    as_int(name, "num_blocks", num_blocks)
    as_int(name, "neighbourhood", neighbourhood)
    if num_blocks < 1 and not image_known:
        raise ValueError(f"{name}: num_blocks must be >= 1, got {num_blocks}")
    if neighbourhood < 2:
        # randint(-1, 1) draws offsets in {-1, 0}; a stable argsort of i + r then keeps every
        # block where it is (a tie keeps the lower index first), so k = 1 would silently
        # never shuffle.
        raise ValueError(
            f"{name}: neighbourhood must be >= 2, got {neighbourhood}: the offsets are drawn from "
            "randint(-k, k), and with k = 1 no block ever moves (k = 2 lets a block move by up to "
            "2 rows and 2 columns)"
        )


def _check_generator(name: str, generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{name}: generator must be a torch.Generator or None, got {type(generator).__name__} {generator!r}"
        )


def _check_args(x: Tensor, num_blocks: int, neighbourhood: int) -> None:
    _check_settings("region_confusion", num_blocks, neighbourhood, image_known=True)
    check_tensor("region_confusion", "x", x)
    if x.dim() not in (3, 4):
        raise ValueError(
            f"region_confusion: x must be an image (C, H, W) or a batch (N, C, H, W), got shape {tuple(x.shape)}"
        )
    if not 1 <= num_blocks <= min(x.shape[-2:]):
        raise ValueError(
            f"region_confusion: num_blocks must be in [1, min(H, W)] = [1, {min(x.shape[-2:])}] for x of shape "
            f"{tuple(x.shape)}, got {num_blocks}"
        )


def _draw_permutations(
    samples: int, n: int, k: int, generator: Optional[torch.Generator], device, p: float = 1.0
) -> Tensor:
    """The cookbook's draws for `samples` images at once, as (samples, n²) block indices.

    Per sample: offsets r ~ randint(-k, k) of shape (n, n) for the row pass, then another
    (n, n) for the column pass, drawn in that order so that the sequence equals the
    reference's sample-by-sample loop. Row pass: σ[:, j] = argsort(i + r[:, j]); column
    pass: τ[i, :] = argsort(j + r'[i, :]); stable sorts. Output block (i, j) is input block
    (σ[i, τ[i, j]], τ[i, j]). Drawn on the generator's device (the CPU by default), so a seed
    gives the same permutations whatever device x is on. With ``p < 1`` each sample is
    shuffled with probability p (one more draw per sample, after the offsets) and otherwise
    gets the identity.
    """
    draw_device = generator.device if generator is not None else torch.device("cpu")
    # generator=None is left out rather than passed: the explicit-generator overload of
    # randint does not take symbolic sizes under torch.compile(dynamic=True).
    rng = {} if generator is None else {"generator": generator}
    r = torch.randint(-k, k, (samples, 2, n, n), device=draw_device, **rng).to(device)
    ar = torch.arange(n, device=device)
    sigma = torch.argsort(ar.view(n, 1) + r[:, 0], dim=1, stable=True)
    tau = torch.argsort(ar.view(1, n) + r[:, 1], dim=2, stable=True)
    perm = (torch.gather(sigma, 2, tau) * n + tau).view(samples, n * n)
    if p < 1.0:
        keep = torch.rand(samples, device=draw_device, **rng).to(device) >= p
        perm = torch.where(keep.unsqueeze(1), torch.arange(n * n, device=device), perm)
    return perm


def region_confusion(
    x: Tensor, num_blocks: int = 7, neighbourhood: int = 2, *, generator: Optional[torch.Generator] = None
) -> tuple[Tensor, Tensor]:
    """DCL's region confusion mechanism (RCM): shuffle each image's ``n × n`` blocks within a
    neighbourhood, exactly as the cookbook's snippet does, for a whole batch at once.

    Every sample gets its own draws; every block moves fewer than ``2k`` block rows and
    ``2k`` block columns. Returns the permutation too: it is the exact label of DCL's
    location loss.

    Args:
        x (Tensor[C, H, W] or Tensor[N, C, H, W]): any dtype, any device, contiguous or
            ``channels_last``. If ``H`` or ``W`` is not divisible by ``n``, blocks are
            ``⌊H/n⌋ × ⌊W/n⌋`` and the remainder rows (bottom) and columns (right) stay put.
        num_blocks: ``n``, in ``[1, min(H, W)]``.
        neighbourhood: ``k >= 2``; offsets are drawn from ``randint(-k, k)``, i.e. [-k, k - 1]
            (with ``k = 1`` no block would ever move, so it is refused).
        generator: the source of randomness (the global CPU generator by default). Draws
            happen on the generator's device, so the same seed gives the same result for x
            on the CPU and on CUDA.

    Under ``torch.compile`` the draws come from Inductor's own random-number kernels, which
    follow the seed but not eager's sequence: for the same permutations as eager from the
    same seed, set ``torch._inductor.config.fallback_random = True`` (Inductor then calls
    eager's generators). An explicit ``generator`` makes Dynamo run the draws eagerly (a
    graph break; ``fullgraph=True`` refuses it).

    Returns:
        ``(shuffled, permutation)``: ``permutation`` is int64 of shape ``(N, n²)`` (``(n²,)``
        for a 3-D x); output block ``b`` is input block ``permutation[..., b]``.
    """
    num_blocks = as_int("region_confusion", "num_blocks", num_blocks)
    neighbourhood = as_int("region_confusion", "neighbourhood", neighbourhood)
    _check_args(x, num_blocks, neighbourhood)
    _check_generator("region_confusion", generator)
    samples = x.shape[0] if x.dim() == 4 else 1
    perm = _draw_permutations(samples, num_blocks, neighbourhood, generator, x.device)
    if x.dim() == 3:
        perm = perm.squeeze(0)
    return permute_blocks(x, perm, num_blocks), perm
