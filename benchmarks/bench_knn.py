"""knn vs torch.cdist + topk, faiss-cpu's exhaustive IndexFlatL2 search, pykeops' argKmin and
the reference (cdist + sort), against the GEMM roofline (the product of the same shape, in
the same cache-sized tiles); with each implementation's accuracy against float64 on the
far-from-origin case, and its peak extra memory."""

import functools

import pytest
import torch
from common import ROOFLINE, run  # benchmarks/ is on sys.path (rootdir-less test folder)

from torchkit import ops, reference

REFERENCE_MAX_ELEMENTS = 2**28  # the reference's (P, R, M) temporary: 1 GiB of float32
KEOPS_MAX_WORK = 2**34  # P·R·M: pykeops' CPU backend has no BLAS (~40 s for the headline)


def cdist_topk(q, g, k):
    d = torch.cdist(q, q if g is None else g)
    if g is None:
        d.fill_diagonal_(float("inf"))  # leave-one-out
    return d.topk(k, dim=-1, largest=False)


def faiss_search(q, g, k):
    import faiss  # benchmark-only dependency

    index = faiss.IndexFlatL2(q.shape[-1])
    index.add((q if g is None else g).numpy())
    d, i = index.search(q.numpy(), k + (g is None))
    d, i = torch.from_numpy(d).sqrt_(), torch.from_numpy(i)
    if g is None:  # drop each row itself (first, unless a duplicate tied with it)
        own = i == torch.arange(len(i)).unsqueeze(1)
        keep = own.to(torch.uint8).sort(dim=1, stable=True).indices[:, :k]
        d, i = d.gather(1, keep), i.gather(1, keep)
    return d, i


@functools.cache
def keops():
    try:
        from pykeops.torch import LazyTensor
    except ImportError as e:  # benchmark-only dependency; the report shows the skip
        pytest.skip(f"pykeops is not installed: {e}")
    return LazyTensor


def keops_argkmin(q, g, k):
    LazyTensor = keops()
    g = q if g is None else g
    d2 = ((LazyTensor(q[:, None, :]) - LazyTensor(g[None, :, :])) ** 2).sum(-1)
    if g is q:  # leave-one-out: one more, then each row's own index dropped
        d, i = d2.Kmin_argKmin(k + 1, dim=1)
        own = i == torch.arange(len(i)).unsqueeze(1)
        keep = own.to(torch.uint8).sort(dim=1, stable=True).indices[:, :k]
        return d.gather(1, keep).sqrt(), i.gather(1, keep)
    d, i = d2.Kmin_argKmin(k, dim=1)
    return d.sqrt(), i


@torch.no_grad()
def tiled_gemm(q, g, k, tile=(1024, 4096)):
    """The products every exact method by the GEMM identity computes: q·gᵀ in 16 MiB tiles."""
    g = q if g is None else g
    out = q.new_empty(tile)
    for i0 in range(0, q.shape[0], tile[0]):
        for j0 in range(0, g.shape[0], tile[1]):
            a, b = q[i0 : i0 + tile[0]], g[j0 : j0 + tile[1]]
            torch.mm(a, b.T, out=out[: len(a), : len(b)])


IMPLS = {
    "torchkit": lambda q, g, k: ops.knn(q, g, k),
    "torch.cdist + topk": cdist_topk,
    "faiss IndexFlatL2": faiss_search,
    "pykeops argKmin": keops_argkmin,
    "reference": lambda q, g, k: reference.knn(q, g, k),
    ROOFLINE: tiled_gemm,
}

# (case, query shape, gallery shape or None for leave-one-out, k, offset, distinct rows or
# None). The two small leave-one-out cases differ only in their rows: every row distinct, or
# drawn from 10 points (duplicates: every distance to one's own point ties at 0). The
# collapsed case is a model whose embeddings collapsed: every query one point, every gallery
# row another, every distance a tie.
CASES = [
    pytest.param("leave-one-out P=R=20000 M=128 k=8", (20000, 128), None, 8, 0.0, None, marks=pytest.mark.headline),
    pytest.param("query→gallery P=1000 R=100000 M=512 k=100", (1000, 512), (100000, 512), 100, 0.0, None),
    pytest.param("leave-one-out P=R=5000 M=128 k=8", (5000, 128), None, 8, 0.0, None),
    pytest.param("far from origin P=2000 R=20000 M=128 k=8", (2000, 128), (20000, 128), 8, 1000.0, None),
    pytest.param("leave-one-out P=R=6000 M=16 k=50", (6000, 16), None, 50, 0.0, None),
    pytest.param("ties: 10 distinct rows, leave-one-out P=R=6000 M=16 k=50", (6000, 16), None, 50, 0.0, 10),
    pytest.param("query→gallery P=2000 R=20000 M=16 k=50", (2000, 16), (20000, 16), 50, 0.0, None),
    pytest.param("ties: collapsed, query→gallery P=2000 R=20000 M=16 k=50", (2000, 16), (20000, 16), 50, 0.0, 1),
]


# On the GPU (names end in the dtype). faiss-gpu and cuVS are not peers here: their wheels
# are built for CUDA 12 and bring their own cuBLAS and runtime, hundreds of MiB that the GPU
# machine cannot install without a network.
def gpu_case(case, query, gallery, k, offset=0.0):
    return pytest.param(case, query, gallery, k, offset, None, marks=pytest.mark.cuda)


GPU_CASES = [
    gpu_case("leave-one-out P=R=20000 M=128 k=8 fp32", (20000, 128), None, 8),
    gpu_case("query→gallery P=1000 R=100000 M=512 k=100 fp32", (1000, 512), (100000, 512), 100),
    gpu_case("query→gallery P=1000 R=100000 M=512 k=100 bf16", (1000, 512), (100000, 512), 100),
    gpu_case("far from origin P=2000 R=20000 M=128 k=8 fp32", (2000, 128), (20000, 128), 8, 1000.0),
    gpu_case("query→gallery P=1000 R=100000 M=128 k=1000 fp32", (1000, 128), (100000, 128), 1000),
]
GPU_IMPLS = ("torchkit", "torch.cdist + topk", ROOFLINE)
GPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def max_rel_error(d, q, g, k):
    """Against the float64 k nearest distances (a wrong neighbour shows as a wrong distance)."""
    truth = ops.knn(q.double(), None if g is None else g.double(), k)[0]
    return ((d.double() - truth).abs() / truth.clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case,query,gallery,k,offset,distinct", CASES + GPU_CASES)
def test_knn(benchmark, case, query, gallery, k, offset, distinct, impl):
    dtype = GPU_DTYPES.get(case.rsplit(" ", 1)[-1])
    device = "cpu" if dtype is None else "cuda"
    if device == "cuda" and impl not in GPU_IMPLS:
        pytest.skip("a CPU-only peer")
    R = (gallery or query)[0]
    work = query[0] * R * query[1]
    if impl == "reference" and work > REFERENCE_MAX_ELEMENTS:
        pytest.skip("the reference's O(P·R·M) temporary exceeds the benchmark's memory budget")
    if impl == "pykeops argKmin" and work > KEOPS_MAX_WORK:
        pytest.skip("pykeops' CPU backend (no BLAS) takes tens of seconds per call here")
    g0 = torch.Generator(device).manual_seed(0)  # drawn where they live
    q = (offset + torch.randn(query, generator=g0, device=device)).to(dtype or torch.float32)
    g = None if gallery is None else (offset + torch.randn(gallery, generator=g0, device=device)).to(q.dtype)
    if distinct:  # each set's rows drawn from its first `distinct` rows
        q = q[torch.randint(distinct, (query[0],), generator=g0, device=device)]
        g = None if g is None else g[torch.randint(distinct, (gallery[0],), generator=g0, device=device)]
    call = functools.partial(IMPLS[impl], q, g, k)
    extra = {"flops": 2 * work}
    if offset and impl != ROOFLINE:
        with torch.no_grad():
            extra["max_rel_error"] = max_rel_error(call()[0], q, g, k)

    def step():
        with torch.no_grad():
            call()

    run(benchmark, step, op="knn", case=case, pass_="forward", impl=impl, device=device, **extra)
