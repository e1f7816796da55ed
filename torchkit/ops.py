"""The fused ops: ``torch.ops.torchkit.*`` behind typed, documented Python functions.

Each op's fake kernel (for ``torch.compile``) and autograd formula are registered here,
next to the function that calls it; schemas and kernels live in ``csrc/``.
"""

from __future__ import annotations

__all__: list[str] = []
