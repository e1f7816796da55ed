"""Drop-in ``torch.nn.Module`` wrappers of ``torchkit.ops``."""

from __future__ import annotations

__all__: list[str] = []
