"""tools/gpu_model.py, the offline performance model: its op counts under the interpreter on
kernels whose work is known, its extrapolation and the bound its prediction picks."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import triton_testing

spec = importlib.util.spec_from_file_location("gpu_model", Path(__file__).parent.parent / "tools" / "gpu_model.py")
gpu_model = importlib.util.module_from_spec(spec)
sys.modules["gpu_model"] = gpu_model  # its dataclasses look their module up
spec.loader.exec_module(gpu_model)

needs_interpreter = pytest.mark.skipif(
    not triton_testing.INTERPRETING or triton_testing.available() is not None,
    reason=str(triton_testing.available() or "a GPU is visible: no interpreter"),
)

if triton_testing.INTERPRETING and triton_testing.available() is None:
    import triton
    import triton.language as tl

    @triton.jit
    def _tile_kernel(a_ptr, b_ptr, out_ptr, N, BLOCK: tl.constexpr, HALF: tl.constexpr):
        """out = exp2(a·b) on BLOCK x BLOCK tiles, rows past N masked: one dot, one exp2 and a
        masked load and store per element."""
        tile = tl.program_id(0) * BLOCK * BLOCK
        i = tl.arange(0, BLOCK)
        offsets = tile + i[:, None] * BLOCK + i[None, :]
        mask = (i < N)[:, None] & (i < BLOCK)[None, :]
        a = tl.load(a_ptr + offsets, mask=mask, other=0.0)
        b = tl.load(b_ptr + offsets)
        if HALF:
            d = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
        else:
            d = tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
        tl.store(out_ptr + offsets, tl.exp2(d), mask=mask)

    @triton.jit
    def _planes_kernel(x_ptr, out_ptr, PLANES, BLOCK: tl.constexpr):
        """out = the sum of PLANES planes of BLOCK x BLOCK, loaded two at a time, the second
        masked by a comparison of the loop's (runtime) counter."""
        i = tl.arange(0, BLOCK)
        at = x_ptr + i[:, None] * BLOCK + i[None, :]
        mask = (i < BLOCK)[:, None] & (i < BLOCK)[None, :]
        total = tl.zeros((BLOCK, BLOCK), tl.float32)
        for j in range(0, PLANES, 2):
            first = tl.load(at + j * BLOCK * BLOCK, mask=mask, other=0.0)
            second = tl.load(at + (j + 1) * BLOCK * BLOCK, mask=mask & (j + 1 < PLANES), other=0.0)
            total += first + second
        tl.store(out_ptr + i[:, None] * BLOCK + i[None, :], total)

    @triton.jit
    def _gather_kernel(x_ptr, out_ptr, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
        """out[i] = x[i·STRIDE]: a gather (one element per access) and a contiguous store."""
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i * STRIDE))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counts_of_a_kernel_whose_work_is_known(dtype):
    B, N, programs = 16, 10, 3
    a, b = (torch.randn(programs, B, B).to(dtype) for _ in range(2))
    out = torch.empty(programs, B, B)
    with gpu_model.counting() as launches:
        _tile_kernel[(programs,)](a, b, out, N, BLOCK=B, HALF=dtype != torch.float32)
    (launch,) = launches
    c = launch.counts
    size = 2 if dtype == torch.bfloat16 else 4
    t = "bf16" if dtype == torch.bfloat16 else "fp32"
    assert launch.kernel == "_tile_kernel" and c["programs"] == programs
    # The interpreter's upcast of bfloat16 operands is a GPU's bf16 product: no conversion left.
    dot = "dot:bf16-mma:fp32" if dtype == torch.bfloat16 else "dot:fp32-ieee:fp32"
    assert c[dot] == programs * B**3
    assert not any(k.startswith("convert:") and v for k, v in c.items())
    assert c["math:exp2:fp32"] == programs * B * B
    assert c[f"load:{t}"] == programs * (N * B + B * B) * size  # the active lanes' bytes
    assert c[f"load-lanes:{t}"] == programs * 2 * B * B  # every lane issues
    assert c["store:fp32"] == programs * N * B * 4
    assert c["touched"] == programs * (N * B * size + B * B * size + N * B * 4)
    # Every integer operation forms addresses or the mask: a GPU does it once per vector
    # access of 16 bytes (its rows are contiguous and aligned), 4 float32 or 8 bfloat16 elements.
    assert not any(k.startswith("int:") and v for k, v in c.items())
    vec = 16 // size
    assert c["addr:addptr:ptr"] == programs * (2 * B * B // vec + B * B // 4)  # a, b; out (float32)
    assert sum(v for k, v in c.items() if k.startswith("addr:and:")) == programs * B * B // vec  # a's mask


@needs_interpreter
def test_a_gather_forms_each_address_alone():
    x = torch.randn(64 * 3)
    out = torch.empty(64)
    with gpu_model.counting() as launches:
        _gather_kernel[(1,)](x, out, STRIDE=3, BLOCK=64)
    c = launches[0].counts
    assert c["addr:addptr:ptr"] == 64 + 64 // 4  # the gather per element, the store per 4
    assert c["addr:mul:i32"] == 64 and not any(k.startswith("int:") and v for k, v in c.items())


@needs_interpreter
def test_a_mask_and_a_loop_counters_comparison_count_the_active_lanes():
    """A mask combined with a comparison of a runtime loop counter: its active lanes' bytes, as
    any mask's (the interpreter may hold such a mask as integers, not as booleans)."""
    B, planes = 16, 3
    x = torch.randn(planes + 1, B, B)
    out = torch.empty(B, B)
    with gpu_model.counting() as launches:
        _planes_kernel[(1,)](x, out, planes, BLOCK=B)
    c = launches[0].counts
    torch.testing.assert_close(out, x[:planes].sum(0))
    assert c["load:fp32"] == planes * B * B * 4 and c["load-lanes:fp32"] == (planes + 1) * B * B
    assert c["waits"] == 2  # (both loads of a step issued before either is used)
    assert c["touched"] == (planes * B * B + B * B) * 4


def test_the_distinct_bytes_touched_past_the_pending_limit():
    """Launch.touch keeps its addresses unique every 2^22 new ones: the distinct bytes are right
    whatever the number of accesses and of distinct addresses, more than that included."""
    launch = gpu_model.Launch("k")
    distinct = (1 << 22) + 12345
    for start in range(0, distinct, 1 << 20):  # every address twice, in overlapping batches
        batch = np.arange(start, min(start + (1 << 21), distinct), dtype=np.int64) * 4
        launch.touch(batch, 4)
    launch.close()
    assert launch.counts["touched"] == distinct * 4


def _wrapper(x):
    """A wrapper as counting() sees one: torch operations before and after a launch."""
    out = torch.empty(64)  # an allocation: no kernel
    y = (x * 2).view(-1)  # a kernel, then a view
    _gather_kernel[(1,)](y, out, STRIDE=3, BLOCK=64)
    total = torch.where(out > 0, out, 0.0).sum()  # two kernels (the 0.0 wrapped on the host: none)
    return float(total)  # its value read back: a synchronisation on a GPU


@needs_interpreter
def test_torch_operations_between_launches_count_as_rows():
    """The torch operations of the functions named (a launch each, the bytes they read and
    write, values read back), one row per gap between launches; none outside them."""
    x = torch.randn(64 * 3)
    with gpu_model.counting((f"{__name__}._wrapper",)) as launches:
        prepared = x + 1  # outside the wrapper: not counted
        _wrapper(prepared)
    before, launch, after = launches
    assert before.kernel == "torch mul" and before.counts["launches"] == 1
    assert before.counts["load:fp32"] == before.counts["store:fp32"] == 192 * 4
    assert launch.kernel == "_gather_kernel"
    assert after.kernel == "torch gt, where, sum, _local_scalar_dense"
    assert after.counts["launches"] == 4 and after.counts["syncs"] == 1
    rows = gpu_model.predict(list(launches), "h200")["launches"]
    assert [r["launches"] for r in rows] == [1, 1, 4]
    assert rows[2]["seconds"] >= 4 * gpu_model.LAUNCH_S


def _checked(x):
    """A wrapper's check of its input's values, as the pair losses' (checks_on_host)."""
    from torchkit.triton import _launch

    if _launch.checks_on_host(x):
        if not bool((x > -100).all()):
            raise ValueError("x must be > -100")
    else:
        torch._assert_async((x > -100).all(), "x must be > -100")


@needs_interpreter
def test_checks_of_values_count_as_on_a_gpu():
    """A check of values counts as a GPU runs it: a device-side assertion, a launch with no
    tensor out, and nothing read back (the interpreter's CPU tensors would read them back)."""
    with gpu_model.counting((f"{__name__}._checked",)) as launches:
        _checked(torch.randn(64))
    (row,) = launches
    assert row.kernel == "torch gt, all, _assert_async"
    assert row.counts["launches"] == 3 and row.counts["syncs"] == 0
    with pytest.raises(ValueError, match="> -100"):  # (and outside the model, on the host)
        _checked(torch.full((3,), -1000.0))


def test_vector_width_of_addresses():
    base = 1 << 20
    rows = base + 4 * (np.arange(4)[:, None] * 16 + np.arange(16)[None, :])  # float32, rows of 16
    assert gpu_model._vector_width(rows, 4) == 4  # 16 bytes at most
    assert gpu_model._vector_width(rows.T, 4) == 4  # contiguous along the other axis
    assert gpu_model._vector_width(rows + 8, 4) == 2  # aligned to 8 bytes only
    assert gpu_model._vector_width(rows + 4, 4) == 1
    assert gpu_model._vector_width(base + 12 * np.arange(16), 4) == 1  # strided
    assert gpu_model._vector_width(base + 2 * np.arange(64), 2) == 8  # bfloat16
    assert gpu_model._vector_width(np.array(base), 4) == 1  # a scalar access


def test_extrapolation_is_exact_for_polynomial_work_and_refuses_different_launches():
    def launches(n):
        return [gpu_model.Launch("k", Counter({"programs": n // 64, "float:fmul:fp32": 3 * n * n + 5 * n}))]

    (at,) = gpu_model.extrapolate([(n, launches(n)) for n in (128, 256, 512)], 8192)
    assert at.counts["programs"] == pytest.approx(128) and at.counts["float:fmul:fp32"] == pytest.approx(
        3 * 8192**2 + 5 * 8192
    )
    other = [gpu_model.Launch("j", Counter())]
    with pytest.raises(ValueError, match="launches differ"):
        gpu_model.extrapolate([(128, launches(128)), (256, other)], 8192)
    # A case counted at its headline size alone is taken as counted.
    (at,) = gpu_model.extrapolate([((1024, 200), launches(1024))], (1024, 200))
    assert at.counts["programs"] == 16 and at.counts["float:fmul:fp32"] == 3 * 1024**2 + 5 * 1024


def test_extrapolation_in_two_variables_is_exact_for_multilinear_work():
    """A proxy loss's work per (embedding, proxy) pair and per row: N·C, N and C terms, fitted
    from the four corners of two sizes of each."""

    def launches(n, c):
        return [gpu_model.Launch("k", Counter({"float:fmul:fp32": 3 * n * c + 5 * n + 7 * c + 11}))]

    corners = [((n, c), launches(n, c)) for n in (128, 256) for c in (64, 128)]
    (at,) = gpu_model.extrapolate(corners, (8192, 11318))
    assert at.counts["float:fmul:fp32"] == pytest.approx(3 * 8192 * 11318 + 5 * 8192 + 7 * 11318 + 11)
    with pytest.raises(ValueError, match="needs 4 runs"):
        gpu_model.extrapolate(corners[:3], (8192, 11318))


def test_the_prediction_takes_the_largest_resource_and_idle_sms():
    flops = 1e9
    fp64 = gpu_model.Launch("k", Counter({"programs": 1320, "float:fmul:fp64": flops, "float:fmul:fp32": flops}))
    row = gpu_model.predict([fp64], "h100")["launches"][0]
    assert row["bound"] == "fp64"  # half the FP32 pipe's rate
    spec = gpu_model.GPUS["h100"]
    assert row["times"]["fp64"] == pytest.approx(flops / (64 * spec["sms"] * spec["clock"]))
    # The same work in 33 programs runs on a quarter of the SMs: four times longer.
    small = gpu_model.Launch("k", Counter({**fp64.counts, "programs": 33}))
    assert gpu_model.predict([small], "h100")["launches"][0]["times"]["fp64"] == pytest.approx(4 * row["times"]["fp64"])
    # Software float64 math counts as its instructions: an exp is 18 float64 operations.
    exp = gpu_model.Launch("k", Counter({"programs": 1320, "math:exp:fp64": flops}))
    assert gpu_model.predict([exp], "h100")["launches"][0]["times"]["fp64"] == pytest.approx(18 * row["times"]["fp64"])


def test_the_calibration_recovers_known_efficiencies():
    """Cases timed as if shared memory ran at 60 % of its peak and latency at 40 %: fit() finds
    both shares and fits only the resources that bound the slowest launch of at least
    FIT_MIN_CASES cases (not the FP32 pipe, which bounds only smaller launches); predict()
    divides each resource's time at peak by its share."""
    rng = np.random.default_rng(0)
    truth = {"smem": 0.6, "latency": 0.4}
    samples = []
    for i in range(8):
        rows = []
        for bound, scale in (("smem" if i % 2 else "latency", 2.0), ("fp32", 0.5), ("fp32", 0.5)):
            times = {k: float(rng.uniform(0.05, 0.5)) * scale * 1e-3 for k in ("smem", "latency", "fp32")}
            times[bound] = float(rng.uniform(1, 3)) * scale * 1e-3
            rows.append({"times": times, "seconds": times[bound], "bound": bound})
        measured = sum(max(v / truth.get(k, 1) for k, v in r["times"].items()) + gpu_model.LAUNCH_S for r in rows)
        samples.append((rows, measured))
    fitted = gpu_model.fit(samples)
    assert fitted == pytest.approx(truth, rel=0.03)
    assert gpu_model.fit(samples[:2]) == {}  # no resource bounds three of two cases
    # predict() divides each resource's time at peak by its share.
    c = Counter({"programs": 1320, "float:fmul:fp32": 1e9})
    at_peak = gpu_model.predict([gpu_model.Launch("k", c)], "h100")["launches"][0]["times"]["fp32"]
    slowed = gpu_model.predict([gpu_model.Launch("k", c)], "h100", {"fp32": 0.5})["launches"][0]["times"]["fp32"]
    assert slowed == pytest.approx(2 * at_peak)


def _marked(**why):
    """A stand-in kernel marked as torchkit.triton._launch.hot marks one."""
    from torchkit.triton._launch import hot

    return hot(**why)(type("Kernel", (), {})())


hot_without_reasons = _marked()
hot_with_reasons = _marked(float64_per_pair="exact decisions", ieee_dot="IEEE products")
unmarked = type("Kernel", (), {})()


def test_the_rule_check_names_hot_kernels_without_a_reason():
    """Per pair: 1 float64 op (past FP64_PER_PAIR) and 128 IEEE multiply-adds break both rules;
    the mark's reasons excuse them; per-row float64 breaks none; an unmarked kernel whose
    products are per pair must be marked."""
    pairs = 1 << 20
    case = gpu_model.Case("op", "case", "forward", None, (), 1024, pairs, ())
    per_pair = Counter({"float:fadd:fp64": pairs, "dot:fp32-ieee:fp32": 128 * pairs})
    per_row = Counter({"float:fadd:fp64": 8 * 1024, "dot:bf16-mma:fp32": 128 * pairs})

    def launch(name, counts):
        return gpu_model.Launch(name, counts, {"module": __name__})

    broken = gpu_model.rules(case, [launch("hot_without_reasons", per_pair)])
    assert {(b["rule"], b["why"]) for b in broken} == {("float64 per pair", None), ("IEEE float32 tl.dot", None)}
    assert [b["per_pair"] for b in broken] == [1, 128]
    broken = gpu_model.rules(case, [launch("hot_with_reasons", per_pair)])
    assert {b["why"] for b in broken} == {"exact decisions", "IEEE products"}
    assert gpu_model.rules(case, [launch("hot_without_reasons", per_row)]) == []
    (unmarked_row,) = gpu_model.rules(case, [launch("unmarked", per_row)])
    assert unmarked_row["why"] is None and "not marked" in unmarked_row["rule"]


@needs_interpreter
@pytest.mark.triton("cdist", dispatch=False)
def test_a_benchmark_case_counts_its_product():
    """cdist at P = R = M = 128 (its benchmark case's run, cases()) at the default fp32-matmul
    setting: the forward multiplies 128³ in its main kernel as three TF32 products each,
    whatever else its launches do; the backward's two products (the gradients of both inputs)
    twice that."""
    split = []
    with gpu_model.counting() as launches:
        gpu_model._cdist(torch.float32, 8192)(128, between=lambda: split.append(len(launches)))

    def macs(part):
        return sum(v for launch in part for k, v in launch.counts.items() if k.startswith("dot:fp32-tf32:"))

    (forward,) = split
    assert macs(launches[:forward]) == 3 * 128**3
    assert macs(launches[forward:]) == 2 * 3 * 128**3


@needs_interpreter
@pytest.mark.triton("triplet_margin_loss", dispatch=False)
@pytest.mark.triton("bilinear_pool", dispatch=False)
def test_the_compiled_code_agrees_with_the_counts(tmp_path, monkeypatch):
    """All triplets' float32 gradient kernel compiled for sm_90 multiplies on tensor cores, as
    its counts say, and so does bilinear_pool's float32 forward GEMM at the default setting
    (wgmma); counts claiming tensor-core work that a kernel's SASS lacks are named."""
    from torchkit.triton import bilinear_pool, pair_losses

    monkeypatch.setattr(gpu_model, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_model, "COMMITTED_COMPILED", str(tmp_path / "compiled.json"))
    g = torch.Generator().manual_seed(0)
    with gpu_model.counting() as launches:
        e, labels = torch.randn(32, 128, generator=g), torch.arange(32) // 8
        _, stats = pair_losses.triplet_margin_forward(e, labels, None, None, 0.05, "all")
        pair_losses.triplet_margin_backward(
            torch.ones(()), e, labels, None, None, stats, 0.05, "all", "euclidean", [True, False]
        )
        bilinear_pool.forward(torch.randn(1, 64, 7, 7, generator=g).relu(), None, 1e-5, 1e-12)
    grad = next(launch for launch in launches if launch.kernel == "band_grad_kernel")
    scalar = next(launch for launch in launches if launch.kernel == "positives_kernel")
    # (bilinear_pool's second forward launch, for scaled samples, has none to multiply here)
    (gemm,) = [
        launch for launch in launches if launch.kernel == "forward_kernel" and launch.counts["dot:fp32-tf32:fp32"]
    ]
    assert any(k.startswith("dot:fp32-tf32") and v for k, v in grad.counts.items())
    assert not any(k.startswith("dot:") and v for k, v in scalar.counts.items())
    gpu_model.compile_launches([grad, scalar, gemm], 1, record=True)
    # The record seeds a fresh clone's cache: nothing compiled again, the same facts.
    facts = [launch.compiled for launch in (grad, scalar, gemm)]
    monkeypatch.setattr(gpu_model, "CACHE", str(tmp_path / "fresh"))
    with monkeypatch.context() as m:
        m.setattr("subprocess.run", lambda *a, **k: pytest.fail("compiled what the record holds"))
        gpu_model.compile_launches([grad, scalar, gemm], 1)
    assert [launch.compiled for launch in (grad, scalar, gemm)] == facts
    for launch in (grad, gemm):
        assert launch.compiled["mma"] == "wgmma" and launch.compiled["sass"]["loops"]["tensor"] > 0
        assert launch.compiled["registers"] > 0 and gpu_model.cross_check(launch) == []
    assert gpu_model.cross_check(scalar) == []
    scalar.counts["dot:bf16-mma:fp32"] = sum(scalar.counts.values())
    assert [d.split(":")[0] for d in gpu_model.cross_check(scalar)] == ["tensor"]


def _ttgir(b_order):
    """A float32 64x64x32 FMA dot as Triton 3.8 lays it out for the pair losses' rows kernel:
    A (64x32) row-major, B (32x64) K-contiguous (`b_order` [0, 1], the transposed rows of
    embeddings) or N-contiguous ([1, 0]), neither swizzled."""
    return f"""#blocked = #ttg.blocked<{{sizePerThread = [4, 4], threadsPerWarp = [2, 16], warpsPerCTA = [8, 1], order = [1, 0]}}>
#shared = #ttg.swizzled_shared<{{vec = 1, perPhase = 1, maxPhase = 1, order = [1, 0]}}>
#shared1 = #ttg.swizzled_shared<{{vec = 1, perPhase = 1, maxPhase = 1, order = {b_order}}}>
    %a = ttg.local_load %a_0 : !ttg.memdesc<64x32xf32, #shared, #smem, mutable> -> tensor<64x32xf32, #ttg.dot_op<{{opIdx = 0, parent = #blocked}}>>
    %b = ttg.local_load %b_0 : !ttg.memdesc<32x64xf32, #shared1, #smem, mutable> -> tensor<32x64xf32, #ttg.dot_op<{{opIdx = 1, parent = #blocked}}>>
    %c = tt.dot %a, %b, %acc : tensor<64x32xf32, #ttg.dot_op<{{opIdx = 0, parent = #blocked}}>> * tensor<32x64xf32, #ttg.dot_op<{{opIdx = 1, parent = #blocked}}>> -> tensor<64x64xf32, #blocked>
"""


def test_shared_memory_wavefronts_of_an_fma_dot():
    """Per warp and K step: 512 FFMA (4x4 outputs x 32 k per thread) and 64 LDS.128 (4 k at a
    time). A's rows are broadcast within each quarter-warp: 4 wavefronts per load. B read along
    K puts the 8 columns of a quarter-warp 128 bytes apart, in the same banks: 8-way conflicts,
    32 wavefronts per load; read along N, one wavefront per quarter."""
    (conflicted,) = gpu_model.fma_dots(_ttgir("[0, 1]"))
    assert conflicted == {"tile": (64, 64, 32), "ffma": 512, "lds": 64, "wavefronts": 32 * 4 + 32 * 32}
    (clean,) = gpu_model.fma_dots(_ttgir("[1, 0]"))
    assert clean == {"tile": (64, 64, 32), "ffma": 512, "lds": 64, "wavefronts": 32 * 4 + 32 * 4}
    # A dot in an MMA layout runs on tensor cores: no FMA dot to cost.
    mma = _ttgir("[1, 0]").replace("-> tensor<64x64xf32, #blocked>", "-> tensor<64x64xf32, #mma>")
    assert gpu_model.fma_dots(mma + "#mma = #ttg.nvidia_mma<{versionMajor = 3}>\n") == []


def test_the_goal_is_the_fastest_peer_of_the_recorded_run():
    """Neither the roofline nor torchkit's other kernels are peers."""
    ours, goals = gpu_model.recorded("h200")
    case = "cdist | P=R=8192 M=128 bf16 | forward"
    assert ours[case] == pytest.approx(1.654e-3, rel=1e-3)
    assert goals[case][0] == "torch.cdist" and goals[case][1] == pytest.approx(0.38e-3, rel=1e-2)
    assert all(not impl.startswith(("torchkit", "roofline")) for impl, _ in goals.values())
    assert gpu_model.recorded("nowhere") == ({}, {})


def test_a_prediction_past_the_committed_one_fails(tmp_path):
    import json

    import triton

    path = tmp_path / "model.json"
    path.write_text(json.dumps({"gpu": "h200", "triton": triton.__version__, "cases": {"a": 1e-3, "b": 2e-3}}))
    lines, failed = gpu_model.regressions({"a": 1.1e-3, "b": 1e-3, "new": 5e-3}, str(path))
    assert not failed and "2 cases" in lines[1]
    slower = gpu_model.REGRESSION * 1.05e-3
    lines, failed = gpu_model.regressions({"a": slower}, str(path))
    assert failed and "a: 1.26×" in lines[-1]
    # Another Triton compiles the kernels otherwise: nothing compared.
    path.write_text(json.dumps({"gpu": "h200", "triton": "0.0", "cases": {"a": 1e-9}}))
    lines, failed = gpu_model.regressions({"a": 1.0}, str(path))
    assert not failed and "Not compared" in lines[-1]


def test_the_cache_key_reads_what_a_module_imports_and_nothing_else(tmp_path, monkeypatch):
    """The cached counts and compiled facts of a kernel module (here family/engine.py) are
    keyed by its source and every torchkit.triton module it imports by name, at the top or
    lazily in a function, inside a package or beside it: changing any of them recounts it, and
    changing another op's module (or a package's __init__.py it does not import) does not."""
    triton_dir = tmp_path / "torchkit" / "triton"
    package = triton_dir / "family"
    package.mkdir(parents=True)
    files = {
        "family/__init__.py": "from torchkit.triton.family import engine\n",
        "family/engine.py": "from torchkit.triton import shared\n\ndef f():\n    from torchkit.triton.family.lazy import x\n",
        "family/lazy.py": "x = 1\n",
        "shared.py": "from torchkit.triton.family import lazy\n",
        "other.py": "from torchkit.triton.family import engine, name_in_the_package\n",
    }
    for name, text in files.items():
        (triton_dir / name).write_text(text)
    monkeypatch.setattr(gpu_model, "ROOT", str(tmp_path))
    read = {os.path.relpath(p, triton_dir) for p in gpu_model._sources(["torchkit.triton.family.engine"])}
    assert read == {"family/engine.py", "family/lazy.py", "shared.py"}
    other = {os.path.relpath(p, triton_dir) for p in gpu_model._sources(["torchkit.triton.other"])}
    assert other == read | {"other.py", "family/__init__.py"}
    before = gpu_model._digest(["torchkit.triton.family.engine"])
    for name, text in files.items():
        (triton_dir / name).write_text(text + "y = 2\n")
        changed = gpu_model._digest(["torchkit.triton.family.engine"]) != before
        assert changed == (name in read), name
        (triton_dir / name).write_text(text)
    assert gpu_model._digest(["torchkit.triton.family.engine"]) == before


def test_each_case_is_keyed_by_its_own_op_s_modules():
    """cdist's and bilinear_pool's cases read their own module and the helpers they import,
    never the other's; the log-sum-exp losses' read lse.py and not the other engines."""
    read = {}
    for case in gpu_model.cases():
        read[case.op] = {os.path.relpath(p, gpu_model.ROOT) for p in gpu_model._sources(case.modules)}
    assert "torchkit/triton/cdist.py" in read["cdist"] and "torchkit/triton/bilinear_pool.py" not in read["cdist"]
    assert (
        "torchkit/triton/bilinear_pool.py" in read["bilinear_pool"]
        and "torchkit/triton/cdist.py" not in read["bilinear_pool"]
    )
    assert "torchkit/triton/pair_losses/lse.py" in read["supcon_loss"]
    assert "torchkit/triton/pair_losses/triplets.py" not in read["supcon_loss"]
    assert "torchkit/triton/pair_losses/triplets.py" in read["triplet_margin_loss"]


@needs_interpreter
@pytest.mark.triton("supcon_loss", dispatch=False)
def test_the_log_sum_exp_engine_is_counted_split_as_at_its_headline_size():
    """The engine splits the refs into as many slices as fill the GPU, which at small sizes is
    every tile: counted so, the programs would extrapolate quadratically. headline_slices
    splits the counted sizes as the headline's, so that the extrapolated grid is the one the
    headline launches, and refuses a size whose tiles cannot split so."""
    from torchkit.triton.pair_losses import lse

    def count(n):
        g = torch.Generator().manual_seed(n)
        e, labels = torch.randn(n, 16, generator=g), torch.arange(n) // 8
        with gpu_model.counting() as launches, gpu_model.headline_slices(n, 8192):
            lse.supcon_forward(e, labels, None, None, 0.1)
        return launches

    runs = [(n, count(n)) for n in (192, 384, 576)]
    rows = lse._rows_default(torch.float32, lse.scheme(torch.float32), lse._held(16, lse.scheme(torch.float32))).kwargs
    slices = lse._slices(8192 // rows["BLOCK_N"], 8192, rows["BLOCK_M"])[0]
    assert 1 < slices < 8192 // rows["BLOCK_M"]
    at = {launch.kernel: launch.counts for launch in gpu_model.extrapolate(runs, 8192)}
    assert at["rows_kernel"]["programs"] == pytest.approx(8192 // rows["BLOCK_N"] * slices)
    # The merge reads every slice's partials once: SupCon's (m, s, sum), float32 planes of slices x N.
    assert at["merge_kernel"]["load:fp32"] == pytest.approx(3 * slices * 8192 * 4)
    with pytest.raises(ValueError, match="headline's 3 slices"):
        count(256)


def test_committed_counts_seed_the_cache_and_a_changed_case_is_counted_again(tmp_path, monkeypatch):
    """model-counts.json round-trips a launch (a Triton dtype among its constexprs, whole
    counts kept whole); a fresh clone's count_cases takes a case whose key it holds without
    counting it, and counts a case whose key changed (its kernels edited since)."""
    import triton.language as tl

    counted = []

    def count_case(index):
        counted.append(index)
        return [gpu_model.Launch("fresh")], 0

    monkeypatch.setattr(gpu_model, "count_case", count_case)  # (before the keys, which read its source)
    every = gpu_model.cases()
    chosen = [i for i, c in enumerate(every) if c.counted == every[0].counted]
    keys = gpu_model.count_keys(chosen)
    spec = {"module": "m", "kernel": "k", "constexprs": {"ACC": tl.float32, "BLOCK": 64}, "divisible": ["x"]}
    launch = gpu_model.Launch("k", Counter({"programs": 64.00000000001, "load:fp32": 0.5, "waits": 0.0}), spec)
    path = tmp_path / "model-counts.json"
    gpu_model.write_counts(str(path), {every[0].counted: (keys[chosen[0]], ([launch], 1))})
    ((back, forward),) = gpu_model.read_counts(str(path)).values()
    assert forward == 1 and back[0].kernel == "k" and back[0].spec == spec
    assert back[0].counts == {"programs": 64, "load:fp32": 0.5} and type(back[0].counts["programs"]) is int

    monkeypatch.setattr(gpu_model, "COMMITTED_COUNTS", str(path))
    monkeypatch.setattr(gpu_model, "CACHE", str(tmp_path / "cache"))  # (a fresh clone's: empty)
    out = gpu_model.count_cases(chosen, jobs=0)
    assert counted == [] and all(out[i][0][0].kernel == "k" for i in chosen)
    # Another key (what an edited kernel gives): counted, not taken from the committed file.
    monkeypatch.setattr(gpu_model, "count_keys", lambda chosen: {i: "edited" for i in chosen})
    assert [x.kernel for x in gpu_model.count_cases(chosen, jobs=0)[chosen[0]][0]] == ["fresh"]
    assert counted == [chosen[0]]
