"""``torchvision.transforms.v2`` transforms built on ``torchkit.ops``."""

from __future__ import annotations

import math
from typing import Any, Optional

import PIL.Image
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from torchkit import ops
from torchkit.ops.region_confusion import _check_args, _check_probability, _check_settings, _draw_permutations

__all__ = ["RandomRegionConfusion"]


class RandomRegionConfusion(v2.Transform):
    """DCL's region confusion (block shuffle within a neighbourhood) as a v2 transform.

    Accepts ``tv_tensors.Image``, plain tensors (``(C, H, W)`` or batched ``(..., C, H, W)``,
    any dtype) and PIL images (returned as PIL images of the same mode), applied to each
    image with probability ``p``; a ``tv_tensors.Mask`` passed along (one per image) is moved
    by the same permutation. Composes with the other v2 transforms. Bounding boxes,
    keypoints and videos are refused.

    DCL's location loss needs the permutation as a label. With ``permutation_key="..."``
    and a dict sample, the transform adds it to the dict under that key: int64 ``(n²,)``
    for one image (``(..., n²)`` for a batch), the identity where the image was not
    shuffled; output block ``b`` is input block ``permutation[b]``::

        rcm = RandomRegionConfusion(7, 2, permutation_key="permutation")
        sample = rcm({"image": image, "label": label})
        sample["permutation"]  # (49,)
    """

    _transformed_types = (tv_tensors.Image, tv_tensors.Mask, torch.Tensor, PIL.Image.Image)

    def __init__(
        self, num_blocks: int = 7, neighbourhood: int = 2, p: float = 1.0, *, permutation_key: Optional[str] = None
    ) -> None:
        super().__init__()
        _check_probability("RandomRegionConfusion", p)
        _check_settings("RandomRegionConfusion", num_blocks, neighbourhood)
        if permutation_key is not None and not isinstance(permutation_key, str):
            raise TypeError(
                f"RandomRegionConfusion: permutation_key must be a str or None, got {type(permutation_key).__name__}"
            )
        self.num_blocks = num_blocks
        self.neighbourhood = neighbourhood
        self.p = p
        self.permutation_key = permutation_key

    def forward(self, *inputs: Any) -> Any:
        if self.permutation_key is None:
            return super().forward(*inputs)
        if len(inputs) != 1 or not isinstance(inputs[0], dict):
            raise TypeError(
                f"RandomRegionConfusion: permutation_key={self.permutation_key!r} adds the permutation to a dict "
                f"sample; call it with one dict (e.g. {{'image': ..., 'label': ...}}), got {len(inputs)} "
                f"input(s) of type {', '.join(type(i).__name__ for i in inputs)}"
            )
        if self.permutation_key in inputs[0]:
            raise ValueError(f"RandomRegionConfusion: the sample already has a key {self.permutation_key!r}")
        out = super().forward(*inputs)
        return {**out, self.permutation_key: self._permutation}

    def check_inputs(self, flat_inputs: list[Any]) -> None:
        unsupported = (tv_tensors.BoundingBoxes, tv_tensors.Video, tv_tensors.KeyPoints)
        for inpt in flat_inputs:
            if isinstance(inpt, unsupported):
                raise TypeError(f"RandomRegionConfusion: cannot move {type(inpt).__name__} with image blocks")

    @staticmethod
    def _is_image(inpt: Any) -> bool:
        return isinstance(inpt, PIL.Image.Image) or (
            isinstance(inpt, torch.Tensor) and not isinstance(inpt, tv_tensors.Mask)
        )

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        image = next((i for i in flat_inputs if self._is_image(i)), None)
        if image is None:
            raise TypeError(
                "RandomRegionConfusion: no image (tv_tensors.Image, plain tensor or PIL image) in the input"
            )
        if isinstance(image, PIL.Image.Image):
            image = F.pil_to_tensor(image)
        if image.dim() < 3:
            raise ValueError(f"RandomRegionConfusion: an image must be (..., C, H, W), got shape {tuple(image.shape)}")
        samples = math.prod(image.shape[:-3])
        _check_args(image.reshape(-1, *image.shape[-3:]), self.num_blocks, self.neighbourhood)
        perm = _draw_permutations(samples, self.num_blocks, self.neighbourhood, None, image.device, self.p)
        # What forward() hands out under permutation_key: shaped as the images' batch.
        self._permutation = perm.reshape(*image.shape[:-3], self.num_blocks**2)
        return dict(permutation=perm, samples=samples, size=tuple(image.shape[-2:]))

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if isinstance(inpt, PIL.Image.Image):
            out = self.transform(F.pil_to_tensor(inpt), params)
            return F.to_pil_image(out, mode=inpt.mode)
        H, W = inpt.shape[-2:]
        samples = params["samples"]
        if samples == 0:
            return inpt
        if inpt.numel() % (samples * H * W) != 0:
            raise ValueError(
                f"RandomRegionConfusion: each image needs its own mask, as each gets its own "
                f"permutation: the input holds {samples} image(s), so a mask must be (..., H, W) with "
                f"{samples} leading entries (H, W = {params['size']}), got shape {tuple(inpt.shape)}"
            )
        batch = inpt.as_subclass(torch.Tensor).reshape(samples, -1, H, W)
        out = ops.permute_blocks(batch, params["permutation"], self.num_blocks).reshape(inpt.shape)
        return tv_tensors.wrap(out, like=inpt) if isinstance(inpt, tv_tensors.TVTensor) else out

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, neighbourhood={self.neighbourhood}, p={self.p}"
