"""A small but real B-CNN (or iSQRT-COV) fine-grained training run on torchkit's ops.

    python examples/bcnn_finegrained.py                    # synthetic data, about a minute on 2 CPU cores
    python examples/bcnn_finegrained.py --reference        # also train with torchkit.reference
    python examples/bcnn_finegrained.py --pool covariance  # iSQRT-COV instead of B-CNN pooling
    python examples/bcnn_finegrained.py --data DIR         # an ImageFolder dataset (DIR/train, DIR/val)
    python examples/bcnn_finegrained.py --loss triplet     # metric learning: a loss on the embeddings
    torchrun --nproc_per_node=2 examples/bcnn_finegrained.py   # DistributedDataParallel (gloo / NCCL)

The model is a torchvision ResNet-18 trunk (``weights=None``: nothing is downloaded unless
``--weights`` names torchvision weights), ``torchkit.ops.bilinear_pool`` (or, with
``--pool covariance``, ``torchkit.ops.covariance_pool``: iSQRT-COV) and a linear classifier,
trained with ``torchkit.nn.LabelSmoothingCrossEntropy`` on images shuffled by
``torchkit.transforms.RandomRegionConfusion`` (or, with ``--loss``, metric learning: one of
torchkit's pair losses on the pooled embeddings, the classifier left out); evaluation reports
the classifier's accuracy
and a nearest-class-mean accuracy on the pooled embeddings through ``torchkit.ops.cdist``, and
their recall@1/2/4/8 through ``torchkit.metrics.recall_at_k``: under ``torchrun``, every process
evaluates its own share of the images and the recall is computed across the processes
(``group=``), without gathering the embeddings.

The default synthetic dataset is fine-grained on purpose: every image is the same kind of
noise with a few small patches of striped texture, and the classes differ only in the
stripes' orientation and spacing, so the model has to learn local second-order texture
statistics, which is what bilinear pooling is for.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchvision.transforms import v2

import torchkit
from torchkit import reference

# ---------------------------------------------------------------------------------------
# Data


class SyntheticFineGrained(torch.utils.data.Dataset):
    """`classes` classes of `size`×`size` RGB uint8 images: noise plus `patches` small patches
    of stripes whose orientation and spacing are the class. Deterministic per index."""

    def __init__(self, length: int, classes: int, size: int, seed: int, patches: int = 3) -> None:
        self.length, self.classes, self.size, self.seed, self.patches = length, classes, size, seed, patches

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % self.classes
        s = self.size
        image = 0.5 + 0.15 * torch.randn(3, s, s, generator=g)
        angle = math.pi * (label % 4) / 4  # four orientations
        period = 3.0 + 2.0 * (label // 4 % 3)  # up to three spacings
        patch = max(6, s // 4)
        yy, xx = torch.meshgrid(torch.arange(patch), torch.arange(patch), indexing="ij")
        phase = torch.rand(1, generator=g) * 2 * math.pi
        stripes = torch.sin(2 * math.pi * (xx * math.cos(angle) + yy * math.sin(angle)) / period + phase)
        for _ in range(self.patches):
            y, x = torch.randint(0, s - patch + 1, (2,), generator=g).tolist()
            tint = 0.2 + 0.3 * torch.rand(3, 1, 1, generator=g)
            image[:, y : y + patch, x : x + patch] += tint * stripes
        return (image.clamp(0, 1) * 255).to(torch.uint8), label


def make_datasets(args):
    """(train with augmentation, train without it (for the class means), val, classes)."""
    mean, std = [0.5] * 3, [0.25] * 3
    # No horizontal flips: they would turn the 45° classes into the 135° ones.
    train_tf = v2.Compose(
        [
            torchkit.transforms.RandomRegionConfusion(args.rcm_blocks, args.rcm_neighbourhood, p=args.rcm_p),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean, std),
        ]
    )
    eval_tf = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    if args.data:
        from torchvision.datasets import ImageFolder

        resize = [v2.ToImage(), v2.Resize((args.image_size, args.image_size), antialias=True)]
        train = ImageFolder(os.path.join(args.data, "train"), transform=v2.Compose([*resize, train_tf]))
        train_eval = ImageFolder(os.path.join(args.data, "train"), transform=v2.Compose([*resize, eval_tf]))
        val = ImageFolder(os.path.join(args.data, "val"), transform=v2.Compose([*resize, eval_tf]))
        return train, train_eval, val, len(train.classes)

    class Transformed(torch.utils.data.Dataset):
        def __init__(self, base, transform):
            self.base, self.transform = base, transform

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            image, label = self.base[i]
            return self.transform(image), label

    train = SyntheticFineGrained(args.train_size, args.classes, args.image_size, seed=1)
    val = SyntheticFineGrained(args.val_size, args.classes, args.image_size, seed=2)
    return Transformed(train, train_tf), Transformed(train, eval_tf), Transformed(val, eval_tf), args.classes


# ---------------------------------------------------------------------------------------
# Model


@dataclass
class Ops:
    """The functions the model and the loop call: torchkit's fused ops or the references."""

    bilinear_pool: object
    covariance_pool: object
    cross_entropy: object
    cdist: object
    pair_losses: object  # the module holding supcon_loss, contrastive_loss, ...


FUSED = Ops(
    torchkit.ops.bilinear_pool,
    torchkit.ops.covariance_pool,
    torchkit.ops.label_smoothing_cross_entropy,
    torchkit.ops.cdist,
    torchkit.ops,
)
REFERENCE = Ops(
    reference.bilinear_pool,
    reference.covariance_pool,
    reference.label_smoothing_cross_entropy,
    reference.cdist,
    reference,
)

# --loss: the metric-learning losses, as (function name, its keyword arguments).
METRIC_LOSSES = {
    "supcon": ("supcon_loss", dict(temperature=0.1)),
    "ntxent": ("ntxent_loss", dict(temperature=0.1)),
    "contrastive": ("contrastive_loss", dict(pos_margin=0.0, neg_margin=1.0)),
    "triplet": ("triplet_margin_loss", dict(margin=0.2, mining="batch_hard")),
}


class BCNN(nn.Module):
    """ResNet-18 up to `stage` (1–4), a 1×1 reduction to `channels`, second-order pooling
    (`pool`: "bilinear", B-CNN's D² features, or "covariance", iSQRT-COV's D(D+1)/2), linear."""

    def __init__(
        self, classes: int, ops: Ops, stage: int, channels: int, weights: str | None, pool: str = "bilinear"
    ) -> None:
        super().__init__()
        from torchvision.models import resnet18

        trunk = resnet18(weights=weights)
        layers = [
            trunk.conv1,
            trunk.bn1,
            trunk.relu,
            trunk.maxpool,
            trunk.layer1,
            trunk.layer2,
            trunk.layer3,
            trunk.layer4,
        ]
        self.features = nn.Sequential(*layers[: 4 + stage])
        width = 64 * 2 ** (stage - 1)
        self.reduce = nn.Sequential(nn.Conv2d(width, channels, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        if pool == "bilinear":
            self.pool, features = ops.bilinear_pool, channels * channels
        else:
            self.pool, features = ops.covariance_pool, channels * (channels + 1) // 2
        self.classifier = nn.Linear(features, classes)

    def embed(self, x: Tensor) -> Tensor:
        return self.pool(self.reduce(self.features(x)))

    def forward(self, x: Tensor, embed: bool = False) -> Tensor:
        """The logits, or with ``embed`` the pooled embeddings (metric learning: called through
        DistributedDataParallel, whose forward synchronises the gradients)."""
        e = self.embed(x)
        return e if embed else self.classifier(e)


# ---------------------------------------------------------------------------------------
# Training

WARMUP_STEPS = 3  # left out of the throughput


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--data", default=None, help="ImageFolder root with train/ and val/; synthetic data if not given")
    p.add_argument("--classes", type=int, default=8, help="synthetic data: number of classes")
    p.add_argument("--train-size", type=int, default=2048, help="synthetic data: training images")
    p.add_argument("--val-size", type=int, default=512, help="synthetic data: validation images")
    p.add_argument("--image-size", type=int, default=64, help="image side in pixels")
    p.add_argument("--epochs", type=int, default=4, help="passes over the training set")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size (split across processes)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (cosine schedule)")
    p.add_argument("--head-lr-scale", type=float, default=20.0, help="classifier learning rate / --lr")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3, 4], help="last ResNet-18 stage used")
    p.add_argument(
        "--pool",
        default="bilinear",
        choices=["bilinear", "covariance"],
        help="second-order pooling: B-CNN's (D² features) or iSQRT-COV's (D(D+1)/2)",
    )
    p.add_argument("--channels", type=int, default=256, help="channels before the pooling (D)")
    p.add_argument(
        "--loss",
        default="cross-entropy",
        choices=["cross-entropy", *METRIC_LOSSES],
        help="the training loss: label-smoothing cross-entropy on the classifier, or metric "
        "learning on the pooled embeddings (supcon, ntxent: temperature 0.1; contrastive: "
        "margins 0 and 1; triplet: margin 0.2, batch-hard mining)",
    )
    p.add_argument("--label-smoothing", type=float, default=0.1, help="ε of the cross-entropy")
    p.add_argument("--rcm-blocks", type=int, default=4, help="RCM grid size n (n×n blocks)")
    p.add_argument("--rcm-neighbourhood", type=int, default=2, help="RCM neighbourhood k (>= 2)")
    p.add_argument("--rcm-p", type=float, default=0.5, help="probability of shuffling an image")
    p.add_argument("--weights", default=None, help="torchvision weights for the trunk, e.g. IMAGENET1K_V1")
    p.add_argument("--reference", action="store_true", help="also train with torchkit.reference and compare")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def setup_distributed():
    """(rank, world size, device) from torchrun's environment; a single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def train(args, ops: Ops, name: str, rank: int = 0, world: int = 1, device: torch.device | None = None) -> dict:
    """Train and evaluate once; returns the losses, accuracies and throughput."""
    from tqdm import tqdm

    device = device or torch.device("cpu")
    torch.manual_seed(args.seed)
    train_set, train_eval, val_set, classes = make_datasets(args)
    sampler = torch.utils.data.DistributedSampler(train_set, seed=args.seed) if world > 1 else None
    loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.batch_size // world,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=True,
    )
    model = BCNN(classes, ops, args.stage, args.channels, args.weights, args.pool).to(device)
    metric = args.loss != "cross-entropy"
    if world > 1:  # (metric learning leaves the classifier out of the graph)
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=metric)
    net = torch.compile(model) if args.compile else model
    steps_per_epoch = len(loader)
    total = args.steps or args.epochs * steps_per_epoch
    # L2-normalised bilinear features are small (‖f‖ = 1 over D² entries): the classifier
    # needs a larger step than the trunk, as in the B-CNN paper's recipe.
    core = model.module if world > 1 else model
    head = list(core.classifier.parameters())
    trunk = [p for p in core.parameters() if all(p is not h for h in head)]
    lrs = [args.lr, args.lr * args.head_lr_scale]
    opt = torch.optim.SGD(
        [dict(params=trunk, lr=lrs[0]), dict(params=head, lr=lrs[1])], momentum=0.9, weight_decay=5e-4
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lrs, total_steps=total, pct_start=0.15)

    losses, seen, step, train_time = [], 0, 0, 0.0
    bar = tqdm(total=total, desc=f"train ({name})", unit="step", disable=args.quiet or rank != 0)
    model.train()
    while step < total:
        if sampler is not None:
            sampler.set_epoch(step // steps_per_epoch)
        for images, labels in loader:
            if step >= total:
                break
            images, labels = images.to(device), labels.to(device)
            start = time.perf_counter()
            if metric:
                function, kwargs = METRIC_LOSSES[args.loss]
                loss = getattr(ops.pair_losses, function)(net(images, embed=True), labels, **kwargs)
            else:
                loss = ops.cross_entropy(net(images), labels, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            step += 1
            # First-call allocations and thread start-up are not throughput (unless that is all).
            if step > WARMUP_STEPS or total <= WARMUP_STEPS:
                train_time += time.perf_counter() - start
                seen += images.shape[0] * world
            bar.set_postfix(loss=f"{losses[-1]:.3f}", img_per_s=f"{seen / max(train_time, 1e-9):.0f}")
            bar.update()
    bar.close()
    result = dict(name=name, losses=losses, images_per_s=seen / max(train_time, 1e-9), steps=step, classes=classes)
    result.update(evaluate(core, train_eval, val_set, classes, ops, device, args, rank, world))
    if metric:
        result["accuracy"] = None  # the classifier was not trained
    return result


@torch.no_grad()
def evaluate(model, train_eval, val_set, classes, ops: Ops, device, args, rank: int = 0, world: int = 1) -> dict:
    """Classifier accuracy, nearest-class-mean accuracy and recall@1/2/4/8 of the pooled
    embeddings. Each process embeds its own contiguous share of the images; the class means
    and the accuracies are summed over the processes, and recall@K ranks every process's
    validation embeddings against all the others' through torchkit's ring (no process
    gathers the embeddings)."""
    model.eval()

    from tqdm import tqdm

    def embed_share(dataset, what):
        share = torch.utils.data.Subset(
            dataset, range(rank * len(dataset) // world, (rank + 1) * len(dataset) // world)
        )
        loader = torch.utils.data.DataLoader(share, batch_size=128, num_workers=args.workers)
        embeddings, logits, labels = [], [], []
        for images, y in tqdm(loader, desc=f"embed {what}", unit="batch", disable=args.quiet or rank != 0):
            e = model.embed(images.to(device))
            embeddings.append(e)
            logits.append(model.classifier(e))
            labels.append(y.to(device))
        return torch.cat(embeddings), torch.cat(logits), torch.cat(labels)

    def summed(t: Tensor) -> Tensor:
        if world > 1:
            dist.all_reduce(t)
        return t

    train_emb, _, train_y = embed_share(train_eval, "train (class means)")
    val_emb, val_logits, val_y = embed_share(val_set, "val")
    sums = summed(torch.zeros(classes, train_emb.shape[1], device=device).index_add_(0, train_y, train_emb))
    counts = summed(torch.bincount(train_y, minlength=classes).to(device))
    means = sums / counts.clamp(min=1).unsqueeze(1)
    ncm = ops.cdist(val_emb, means).argmin(1)
    correct = summed(torch.stack([(val_logits.argmax(1) == val_y).sum(), (ncm == val_y).sum()]))
    model.train()
    return dict(
        accuracy=correct[0].item() / len(val_set),
        ncm_accuracy=correct[1].item() / len(val_set),
        # Retrieval quality of the embeddings, leave-one-out over the whole validation set.
        recall=torchkit.metrics.recall_at_k(
            val_emb, val_y, (1, 2, 4, 8), group=dist.group.WORLD if world > 1 else None
        ),
    )


def summary(result: dict) -> str:
    first, last = (
        sum(result["losses"][:10]) / min(10, len(result["losses"])),
        sum(result["losses"][-10:]) / min(10, len(result["losses"])),
    )
    text = f"{result['name']}: {result['steps']} steps, loss {first:.3f} → {last:.3f}"
    text += f", {result['images_per_s']:.1f} images/s"
    if result.get("accuracy") is not None:
        text += f", val accuracy {result['accuracy']:.1%} (nearest class mean {result['ncm_accuracy']:.1%}"
        text += f"; chance {1 / result['classes']:.1%})"
    elif "ncm_accuracy" in result:
        text += f", val nearest-class-mean accuracy {result['ncm_accuracy']:.1%}"
        text += f" (chance {1 / result['classes']:.1%})"
    if "recall" in result:
        text += ", recall@1/2/4/8 " + "/".join(f"{100 * r:.1f}" for r in result["recall"].values()) + " %"
    return text


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} processes")
    torch.set_float32_matmul_precision("highest")
    results = [train(args, FUSED, "torchkit", rank, world, device)]
    if args.reference:
        results.append(train(args, REFERENCE, "reference", rank, world, device))
    if rank == 0:
        for r in results:
            print(summary(r))
        if args.reference:
            print(f"speed-up of a training step: {results[0]['images_per_s'] / results[1]['images_per_s']:.2f}×")
    if world > 1:
        dist.barrier()  # no rank tears its connections down while another still talks to it
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
