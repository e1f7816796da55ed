"""Pure-PyTorch reference implementations: the cookbook formulations, short and obvious.

Same signatures as ``torchkit.ops``; tests use them as oracles and benchmarks as peers.
"""

from __future__ import annotations

__all__: list[str] = []
