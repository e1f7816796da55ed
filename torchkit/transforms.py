"""``torchvision.transforms.v2`` transforms built on ``torchkit.ops``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

from torchkit import ops
from torchkit.ops.region_confusion import _check_probability, _check_rcm_args, _rcm_permutations

__all__ = ["RandomRegionConfusion"]


class RandomRegionConfusion(v2.Transform):
    """DCL's region confusion (block shuffle within a neighbourhood) as a v2 transform.

    Accepts ``tv_tensors.Image`` and plain tensors (``(C, H, W)`` or batched ``(..., C, H, W)``,
    any dtype), applied to each image with probability ``p``; a ``tv_tensors.Mask`` passed
    along is moved by the same permutation. Composes with the other v2 transforms. The
    permutation itself is not returned (a transform cannot add outputs): where it is needed
    as a label, use :func:`torchkit.ops.region_confusion` or :class:`torchkit.nn.RegionConfusion`.
    Bounding boxes, keypoints, videos and PIL images are refused: move them through
    ``v2.ToImage`` first, or use a transform that knows how to move them.
    """

    _transformed_types = (tv_tensors.Image, tv_tensors.Mask, torch.Tensor)

    def __init__(self, num_blocks: int = 7, neighbourhood: int = 2, p: float = 1.0) -> None:
        super().__init__()
        _check_probability("RandomRegionConfusion", p)
        if num_blocks < 1 or neighbourhood < 1:
            raise ValueError(
                "RandomRegionConfusion: num_blocks and neighbourhood must be >= 1, "
                f"got {num_blocks} and {neighbourhood}"
            )
        self.num_blocks = num_blocks
        self.neighbourhood = neighbourhood
        self.p = p

    def check_inputs(self, flat_inputs: list[Any]) -> None:
        unsupported = (tv_tensors.BoundingBoxes, tv_tensors.Video, tv_tensors.KeyPoints)
        for inpt in flat_inputs:
            if isinstance(inpt, unsupported) or type(inpt).__module__.startswith("PIL"):
                raise TypeError(f"RandomRegionConfusion: cannot move {type(inpt).__name__} with image blocks")

    @staticmethod
    def _is_image(inpt: Any) -> bool:
        return isinstance(inpt, torch.Tensor) and not isinstance(inpt, tv_tensors.Mask)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        image = next((i for i in flat_inputs if self._is_image(i)), None)
        if image is None:
            raise TypeError("RandomRegionConfusion: no image (tv_tensors.Image or plain tensor) in the input")
        if image.dim() < 3:
            raise ValueError(f"RandomRegionConfusion: an image must be (..., C, H, W), got shape {tuple(image.shape)}")
        samples = math.prod(image.shape[:-3])
        _check_rcm_args(image.reshape(-1, *image.shape[-3:]), self.num_blocks, self.neighbourhood)
        perm = _rcm_permutations(samples, self.num_blocks, self.neighbourhood, None, image.device, self.p)
        return dict(permutation=perm, samples=samples)

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        H, W = inpt.shape[-2:]
        batch = inpt.as_subclass(torch.Tensor).reshape(params["samples"], -1, H, W)
        out = ops.permute_blocks(batch, params["permutation"], self.num_blocks).reshape(inpt.shape)
        return tv_tensors.wrap(out, like=inpt) if isinstance(inpt, tv_tensors.TVTensor) else out

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, neighbourhood={self.neighbourhood}, p={self.p}"
