"""The pair losses (supcon_loss, ntxent_loss, contrastive_loss, triplet_margin_loss with each
mining, multi_similarity_loss with its miner) vs pytorch-metric-learning (the library our users
run, with its miners), the full-matrix references and their torch.compile, and on the GPU
SupCon, NT-Xent and proxy-anchor on flex_attention (flex_losses.py) and two-view NT-Xent on
Inf-CL (where `inf_cl` is installed); forward and
forward+backward, with each one's peak extra memory, against the GEMM roofline: the N×N
similarity product (forward), plus the backward's product of the same shape. Peers' cases
that cannot run in this machine's memory are skipped with the size they ask for."""

import functools

import pytest
import torch
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)
from pytorch_metric_learning import losses, miners
from pytorch_metric_learning.distances import CosineSimilarity

from torchkit import ops, reference

PML = "pytorch-metric-learning"
# Each loss with its default parameters, the triplet loss with each mining, and the Euclidean
# losses with PML's CosineSimilarity() as its users configure them (distance="cosine").
VARIANTS = {
    "supcon_loss": ("supcon_loss", {"temperature": 0.1}),
    "ntxent_loss": ("ntxent_loss", {"temperature": 0.07}),
    "contrastive_loss": ("contrastive_loss", {"pos_margin": 0.0, "neg_margin": 1.0, "distance": "euclidean"}),
    "contrastive_loss cosine": ("contrastive_loss", {"pos_margin": 1.0, "neg_margin": 0.0, "distance": "cosine"}),
    "triplet all": ("triplet_margin_loss", {"margin": 0.05, "mining": "all", "distance": "euclidean"}),
    "triplet semi_hard": ("triplet_margin_loss", {"margin": 0.05, "mining": "semi_hard", "distance": "euclidean"}),
    "triplet batch_hard": ("triplet_margin_loss", {"margin": 0.05, "mining": "batch_hard", "distance": "euclidean"}),
    "triplet batch_hard cosine": (
        "triplet_margin_loss",
        {"margin": 0.1, "mining": "batch_hard", "distance": "cosine"},
    ),
    "multi_similarity_loss": ("multi_similarity_loss", {"alpha": 2.0, "beta": 50.0, "base": 0.5, "miner_epsilon": 0.1}),
}
BUDGET = 8 * 2**30  # bytes a peer may ask for on this machine (24 GiB, shared)


def pml_fn(variant):
    """PML's loss with the miner the mining names, as fn(embeddings, labels)."""
    loss, params = VARIANTS[variant]
    distance = {"distance": CosineSimilarity()} if params.get("distance") == "cosine" else {}
    if loss == "supcon_loss":
        return losses.SupConLoss(**params)
    if loss == "ntxent_loss":
        return losses.NTXentLoss(**params)
    if loss == "contrastive_loss":
        return losses.ContrastiveLoss(params["pos_margin"], params["neg_margin"], **distance)
    if loss == "multi_similarity_loss":
        ms = losses.MultiSimilarityLoss(alpha=params["alpha"], beta=params["beta"], base=params["base"])
        ms_miner = miners.MultiSimilarityMiner(epsilon=params["miner_epsilon"])
        return lambda e, labels: ms(e, labels, ms_miner(e, labels))
    triplet = losses.TripletMarginLoss(margin=params["margin"], **distance)
    if params["mining"] == "all":
        return triplet
    miner = (
        miners.BatchHardMiner(**distance)
        if params["mining"] == "batch_hard"
        else miners.TripletMarginMiner(margin=params["margin"], type_of_triplets="semihard", **distance)
    )
    return lambda e, labels: triplet(e, labels, miner(e, labels))


@functools.cache
def compiled_reference(loss):
    return torch.compile(getattr(reference, loss))


@torch.no_grad()
def gemm_roofline(e, backward=False):
    s = e @ e.T
    if backward:
        s @ e
    return s


def peer_bytes(impl, variant, N, per_class):
    """At least what a full-matrix peer allocates at once: N×N float32 masks and matrices; for
    PML's NT-Xent, its (positive pairs × negative pairs) float32 matrix; for all (and
    semi-hard) triplets, an N×N×N byte mask, and PML's three int64 index lists per triplet."""
    loss, params = VARIANTS[variant]
    if loss == "ntxent_loss" and impl == PML:
        return N * (per_class - 1) * N * (N - per_class) * 4
    if params.get("mining") in ("all", "semi_hard"):
        return N**3 + (24 * N * (per_class - 1) * (N - per_class) if impl == PML else 0)
    return 6 * N * N * 4


TRITON = "torchkit (triton)"  # GPU cases only: its kernels are staged until a GPU run measures them


class TritonPairLoss(torch.autograd.Function):
    """A pair loss through its Triton kernels (torchkit/triton/pair_losses.py), which serve
    CUDA tensors only under TORCHKIT_CUDA_KERNELS=triton: called directly here, so that a run
    needs no environment. params: the schema's, in its order (VARIANTS' dicts keep it)."""

    @staticmethod
    def forward(ctx, e, labels, name, params):
        from torchkit.triton import pair_losses as kernels

        value, stats = getattr(kernels, f"{name}_forward")(e, labels, None, None, *params)
        ctx.save_for_backward(e, labels, stats)
        ctx.args = (name, params)
        return value

    @staticmethod
    def backward(ctx, grad):
        from torchkit.triton import pair_losses as kernels

        e, labels, stats = ctx.saved_tensors
        name, params = ctx.args
        backward = getattr(kernels, f"{name}_backward")
        ge, _ = backward(grad, e, labels, None, None, stats, *params, [True, False])
        return ge, None, None, None


FLEX = "flex_attention"  # GPU cases only: its backward does not run on the CPU
FLEX_LOSSES = ("supcon_loss", "ntxent_loss")


@functools.cache
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_loss(loss, params):
    """SupCon or NT-Xent on torch.compile(flex_attention), as a user writes them (flex_losses.py)."""
    import flex_losses

    return functools.partial(getattr(flex_losses, loss), flex=compiled_flex(), **params)


INFCL = "inf-cl"  # GPU, two-view NT-Xent only: Inf-CL's kernels are Triton's, for CUDA tensors


def infcl_ntxent(loss, params):
    """Two-view NT-Xent as a user writes it on Inf-CL (inf_cl.cal_inf_loss, one process: its
    flash kernels): the cross-view InfoNCE of the normalised views, both ways, views 2i and
    2i + 1 (the two-view case's labels). Inf-CL has no same-view negatives, so its value is not
    NT-Xent's: it stands beside ours for time and memory at batch sizes past the N×N matrix.
    The temperature divides the inputs (its `scale` argument would take a gradient through an
    all-reduce)."""
    import torch.nn.functional as F
    from inf_cl import cal_inf_loss

    def fn(e, labels):
        z = F.normalize(e, dim=-1)
        a, b = z[0::2].contiguous(), z[1::2].contiguous()
        t, D = params["temperature"], e.shape[1]
        return (cal_inf_loss(a / t, b, head_dim=D) + cal_inf_loss(b / t, a, head_dim=D)) / 2

    return fn


def triton_loss(loss, params):
    name, values = loss.removesuffix("_loss"), tuple(params.values())
    return lambda e, labels: TritonPairLoss.apply(e, labels, name, values)


IMPLS = {
    "torchkit": lambda loss, params: functools.partial(getattr(ops, loss), **params),
    TRITON: triton_loss,
    FLEX: flex_loss,
    INFCL: infcl_ntxent,
    "reference": lambda loss, params: functools.partial(getattr(reference, loss), **params),
    "torch.compile(reference)": lambda loss, params: functools.partial(compiled_reference(loss), **params),
    ROOFLINE: lambda loss, params: gemm_roofline,
}

# (case, N, D, samples per class, dtype, device, rows): rows "random" (normal draws), or a
# collapsed batch, as a model early in training gives: every row one point ("one point") or 0
# ("zero"), where every pair's distance cancels and every choice ties (torchkit against PML and
# against its own random case of the same size only). The GPU's largest batch is two views of
# each sample (SimCLR's), NT-Xent's only: where the N×N matrix no longer fits, and Inf-CL runs.
CASES = [
    pytest.param("N=1024 D=512 8/class fp32", 1024, 512, 8, torch.float32, "cpu", "random", marks=pytest.mark.headline),
    pytest.param("N=8192 D=128 8/class fp32", 8192, 128, 8, torch.float32, "cpu", "random"),
    *(
        pytest.param(f"N=1024 D=512 8/class fp32 collapsed: {rows}", 1024, 512, 8, torch.float32, "cpu", rows)
        for rows in ("one point", "zero")
    ),
    *(
        pytest.param(f"N={N} D={D} {k}/class {name}", N, D, k, dtype, "cuda", "random", marks=pytest.mark.cuda)
        for N, D, k in ((1024, 512, 8), (8192, 128, 8), (65536, 128, 2))
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    ),
]


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", [*IMPLS, PML])
@pytest.mark.parametrize("case,N,D,per_class,dtype,device,rows", CASES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pair_loss(benchmark, variant, case, N, D, per_class, dtype, device, rows, impl, pass_):
    loss, params = VARIANTS[variant]
    if rows != "random" and impl not in ("torchkit", PML):
        pytest.skip("collapsed batches: torchkit and PML only")
    if impl == TRITON and device != "cuda":
        pytest.skip("Triton kernels: on CUDA tensors (the tests run them interpreted)")
    if impl == TRITON and params.get("distance") == "cosine":
        pytest.skip("Triton kernels: the Euclidean distance only")
    if impl == FLEX and (device != "cuda" or loss not in FLEX_LOSSES):
        pytest.skip("flex_attention: SupCon and NT-Xent (no mining), on CUDA (its backward does not run on the CPU)")
    if per_class == 2 and loss != "ntxent_loss":
        pytest.skip("two views of each sample: NT-Xent's case")
    if impl == INFCL:
        if device != "cuda" or per_class != 2:
            pytest.skip("Inf-CL: two-view NT-Xent on CUDA")
        pytest.importorskip("inf_cl", reason="Inf-CL (pip install inf-cl) is not installed")
    if impl == "torchkit" and device != "cpu":
        pytest.skip("torchkit's CUDA kernels for the pair losses are the staged Triton ones")
    if impl in (PML, "reference", "torch.compile(reference)") and peer_bytes(impl, variant, N, per_class) > BUDGET:
        gib = peer_bytes(impl, variant, N, per_class) / 2**30
        pytest.skip(f"{impl} would need at least {gib:.0f} GiB here")
    g = torch.Generator(device).manual_seed(0)
    e = torch.randn(N if rows == "random" else 1, D, generator=g, device=device).to(dtype)
    e = (e if rows != "zero" else torch.zeros_like(e)).expand(N, D).contiguous()
    labels = torch.arange(N, device=device) // per_class
    fn = pml_fn(variant) if impl == PML else IMPLS[impl](loss, params)
    extra = {"flops": 2 * N * N * D * (1 if pass_ == "forward" else 2)}
    if impl == ROOFLINE:

        def step():
            fn(e, backward=pass_ != "forward")
    elif pass_ == "forward":

        def step():
            with torch.no_grad():
                fn(e, labels)
    else:
        e.requires_grad_()

        def step():
            fn(e, labels).backward()
            e.grad = None

    if loss == "triplet_margin_loss":
        case = f"{case} {params['mining']}"
    if params.get("distance") == "cosine":
        case = f"{case} cosine"
    run(benchmark, step, op=loss, case=case, pass_=pass_, impl=impl, device=device, **extra)


# The losses given a PML miner's tuple (indices_tuple=): the miner runs once, untimed (both
# take its output); torchkit's loss on the list against PML's loss on the same list.
MINED = {
    "contrastive_loss PairMarginMiner": (
        "contrastive_loss",
        lambda: miners.PairMarginMiner(0.8, 1.2),
        lambda: losses.ContrastiveLoss(0.0, 1.0),
    ),
    "triplet_margin_loss TripletMarginMiner hard": (
        "triplet_margin_loss",
        lambda: miners.TripletMarginMiner(0.05, type_of_triplets="hard"),
        lambda: losses.TripletMarginLoss(0.05),
    ),
    "triplet_margin_loss BatchHardMiner": (
        "triplet_margin_loss",
        lambda: miners.BatchHardMiner(),
        lambda: losses.TripletMarginLoss(0.05),
    ),
    "supcon_loss MultiSimilarityMiner": (
        "supcon_loss",
        lambda: miners.MultiSimilarityMiner(0.1),
        lambda: losses.SupConLoss(0.1),
    ),
}


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", ["torchkit", PML])
@pytest.mark.parametrize("variant", list(MINED))
def test_pair_loss_on_a_miners_tuple(benchmark, variant, impl, pass_):
    loss, miner, pml_loss = MINED[variant]
    N, D = 1024, 512
    g = torch.Generator().manual_seed(0)
    e = torch.randn(N, D, generator=g)
    labels = torch.arange(N) // 8
    tuple_of = miner()(e, labels)
    if impl == PML:
        fn = functools.partial(pml_loss(), indices_tuple=tuple_of)
    else:
        fn = functools.partial(getattr(ops, loss), indices_tuple=tuple_of)
    if pass_ == "forward":

        def step():
            with torch.no_grad():
                fn(e, labels)
    else:
        e.requires_grad_()

        def step():
            fn(e, labels).backward()
            e.grad = None

    case = f"N={N} D={D} 8/class fp32 {variant.split(' ', 1)[1]} ({len(tuple_of[0])} listed)"
    run(benchmark, step, op=loss, case=case, pass_=pass_, impl=impl, device="cpu")


@torch.no_grad()
def proxy_roofline(e, proxies, backward=False):
    s = e @ proxies.T
    if backward:
        s @ proxies, s.T @ e
    return s


def pml_proxy_anchor(C, D):
    """PML's ProxyAnchorLoss holding the given proxies, as fn(embeddings, labels, proxies)."""
    loss = losses.ProxyAnchorLoss(C, D)
    del loss.proxies  # the benchmark's tensor instead of its parameter

    def fn(e, labels, proxies):
        loss.proxies = proxies
        return loss(e, labels)

    return fn


class TritonProxyAnchor(torch.autograd.Function):
    """proxy_anchor_loss through its Triton kernels (as TritonPairLoss)."""

    @staticmethod
    def forward(ctx, e, labels, proxies):
        from torchkit.triton import pair_losses as kernels

        value, stats = kernels.proxy_anchor_forward(e, labels, proxies, 0.1, 32.0)
        ctx.save_for_backward(e, labels, proxies, stats)
        return value

    @staticmethod
    def backward(ctx, grad):
        from torchkit.triton import pair_losses as kernels

        e, labels, proxies, stats = ctx.saved_tensors
        ge, gp = kernels.proxy_anchor_backward(grad, e, labels, proxies, stats, 0.1, 32.0, [True, True])
        return ge, None, gp


def flex_proxy_anchor(C, D):
    import flex_losses

    return functools.partial(flex_losses.proxy_anchor_loss, flex=compiled_flex())


PROXY_IMPLS = {
    "torchkit": lambda C, D: ops.proxy_anchor_loss,
    TRITON: lambda C, D: TritonProxyAnchor.apply,
    FLEX: flex_proxy_anchor,
    "reference": lambda C, D: reference.proxy_anchor_loss,
    "torch.compile(reference)": lambda C, D: compiled_reference("proxy_anchor_loss"),
    PML: pml_proxy_anchor,
}

# (case, N, D, classes): CUB-200's batch and classes; Stanford Online Products' 11,318 classes.
PROXY_CASES = [
    pytest.param("N=1024 D=512 C=200 fp32", 1024, 512, 200, "cpu", marks=pytest.mark.headline),
    pytest.param("N=1024 D=512 C=11318 fp32", 1024, 512, 11318, "cpu"),
    *(
        pytest.param(f"N={N} D=512 C={C} fp32", N, 512, C, "cuda", marks=pytest.mark.cuda)
        for N, C in ((1024, 200), (1024, 11318), (8192, 11318))
    ),
]


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("impl", [*PROXY_IMPLS, ROOFLINE])
@pytest.mark.parametrize("case,N,D,C,device", PROXY_CASES)
def test_proxy_anchor_loss(benchmark, case, N, D, C, device, impl, pass_):
    if impl == TRITON and device != "cuda":
        pytest.skip("the Triton kernels run on CUDA tensors (the tests run them interpreted)")
    if impl == FLEX and device != "cuda":
        pytest.skip("flex_attention: on CUDA (its backward does not run on the CPU)")
    if impl == "torchkit" and device != "cpu":
        pytest.skip("torchkit's CUDA kernels for the pair losses are the staged Triton ones")
    g = torch.Generator(device).manual_seed(0)
    e = torch.randn(N, D, generator=g, device=device)
    proxies = torch.randn(C, D, generator=g, device=device)
    labels = torch.randint(C, (N,), generator=g, device=device)
    extra = {"flops": 2 * N * C * D * (1 if pass_ == "forward" else 3)}
    if impl == ROOFLINE:

        def step():
            proxy_roofline(e, proxies, backward=pass_ != "forward")
    else:
        fn = PROXY_IMPLS[impl](C, D)
        if pass_ == "forward":

            def step():
                with torch.no_grad():
                    fn(e, labels, proxies)
        else:
            e.requires_grad_()
            proxies.requires_grad_()

            def step():
                fn(e, labels, proxies).backward()
                e.grad = proxies.grad = None

    run(benchmark, step, op="proxy_anchor_loss", case=case, pass_=pass_, impl=impl, device=device, **extra)
