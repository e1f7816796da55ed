"""How far torchkit's region confusion moves blocks, per neighbourhood k (README's RCM table).

    python tools/region_confusion_displacement.py [--blocks 7] [--draws 20000]

For each k: the fraction of blocks that move, the largest displacement (in block rows or
columns, whichever is larger), and its mean over the moved blocks, over `draws` images.
"""

import argparse

import torch

from torchkit import ops


def stats(n: int, k: int, draws: int) -> tuple[float, int, float]:
    g = torch.Generator().manual_seed(0)
    _, perm = ops.region_confusion(torch.zeros(draws, 1, n, n), n, k, generator=g)
    b = torch.arange(n * n)
    # Output block b holds input block perm[b]: its displacement is |perm[b] - b| per axis.
    d = torch.maximum((perm // n - b // n).abs(), (perm % n - b % n).abs())
    moved = d > 0
    return moved.float().mean().item(), int(d.max()), d[moved].float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--draws", type=int, default=20000)
    args = parser.parse_args()
    print(f"| k | blocks moved | largest move | mean move of a moved block |  (n = {args.blocks}, {args.draws} draws)")
    print("|---|---|---|---|")
    for k in (2, 3, 4):
        moved, largest, mean = stats(args.blocks, k, args.draws)
        print(f"| {k} | {100 * moved:.0f} % | {largest} | {mean:.2f} |")


if __name__ == "__main__":
    main()
