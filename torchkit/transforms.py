"""``torchvision.transforms.v2`` transforms built on ``torchkit.ops``."""

from __future__ import annotations

__all__: list[str] = []
