"""Shared test vocabulary: devices, dtypes, and the checks every op's tests run.

Test modules import these names (`from testing import DEVICES, assert_close_reduced, ...`);
tests/ is on sys.path because pytest puts a rootdir-less test folder there.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from torchkit import ops

# `cuda` tests are skipped, not dropped, where no GPU is visible (conftest.py), so a CPU run
# reports what it left out.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def with_triton(op: str, devices: list | None = None) -> list:
    """`devices` (DEVICES by default), and the same tests through op's Triton kernels: under
    the interpreter on CPU tensors (id "triton") and compiled on CUDA tensors (id "triton-cuda")."""
    return [
        *(DEVICES if devices is None else devices),
        pytest.param("cpu", id="triton", marks=pytest.mark.triton(op)),
        pytest.param("cuda", id="triton-cuda", marks=[pytest.mark.triton(op), pytest.mark.cuda]),
    ]


def as_param(device):
    """A DEVICES entry as a pytest.param (a plain string becomes one without marks), for
    parametrize lists that combine devices with other values."""
    return device if hasattr(device, "values") else pytest.param(device, id=device)


FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
REDUCED_DTYPES = [torch.float16, torch.bfloat16]

# Tolerances for comparing against a reference computed in the same dtype.
TOLERANCES = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **overrides) -> None:
    """`torch.testing.assert_close` with this project's per-dtype tolerances."""
    tol = {**TOLERANCES[expected.dtype], **overrides}
    torch.testing.assert_close(actual, expected, **tol)


def assert_close_reduced(
    actual: torch.Tensor, baseline: torch.Tensor, reference64: torch.Tensor, ulps: float = 1.0
) -> None:
    """Reduced-precision rule: `actual`'s error against a float64 reference is at most twice
    the error of `baseline` (the plain PyTorch composition computed in float32, rounded to
    `actual`'s dtype), with `ulps` units in the last place of the output as the floor."""
    assert actual.dtype == baseline.dtype, (actual.dtype, baseline.dtype)
    assert not actual.isnan().any() or reference64.isnan().any(), "NaN where the reference has none"
    ref = reference64.double()
    err = (actual.double() - ref).abs().max().item() if ref.numel() else 0.0
    base = (baseline.double() - ref).abs().max().item() if ref.numel() else 0.0
    ulp = ulps * torch.finfo(actual.dtype).eps * (ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= max(2 * base, ulp), f"error {err:.3g} > 2 x baseline error {base:.3g} (ulp floor {ulp:.3g})"


def make_noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as `t` in a tensor whose every dimension is strided (every other element)."""
    big = torch.empty([2 * s for s in t.shape], dtype=t.dtype, device=t.device)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    assert t.dim() == 0 or t.numel() <= 1 or not view.is_contiguous()
    return view.requires_grad_(t.requires_grad)


def check_gradcheck(fn, inputs: tuple, **kwargs) -> None:
    """float64 `gradcheck` (and `gradgradcheck` is not claimed: backward ops are not differentiable)."""
    assert all(not torch.is_tensor(x) or not x.is_floating_point() or x.dtype == torch.float64 for x in inputs)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, **kwargs)


def check_opcheck(op, args: tuple, kwargs: dict | None = None) -> None:
    """`torch.library.opcheck`: schema, fake kernel, autograd registration and AOT dispatch."""
    torch.library.opcheck(op, args, kwargs or {})


@functools.cache
def compiled(fn, dynamic: bool = True):
    """`torch.compile(fn, fullgraph=True)`; cached so parametrised tests share one compilation."""
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)


def check_compile(fn, *args, **kwargs) -> None:
    """The compiled function (fullgraph, dynamic shapes) agrees with eager: its output and,
    through the compiled backward graph, the gradients of the inputs that require them."""
    leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]
    eager = fn(*args, **kwargs)
    out = compiled(fn)(*args, **kwargs)
    torch.testing.assert_close(out, eager)
    if leaves:
        g = torch.randn_like(eager)
        torch.testing.assert_close(torch.autograd.grad(out, leaves, g), torch.autograd.grad(eager, leaves, g))


_DYNAMO_DROPS_MESSAGES = Version(torch.__version__).release < (2, 11)


def check_compiled_refuses_like_eager(monkeypatch, names: list[str], call) -> None:
    """`call()` (which builds bad input eagerly and calls `torchkit.ops.<name>`) raises the
    same message with each op compiled (fullgraph, static shapes) as eagerly: the fake kernels
    refuse what the kernels refuse, or leave it to the kernel the compiled graph calls.
    Without fullgraph, the compiled call raises eager's exception itself, type included: the
    Python functions check their arguments before the op, where Dynamo would wrap a fake
    kernel's exception in its TorchRuntimeError."""
    with pytest.raises(Exception) as eager:
        call()
    originals = {name: getattr(ops, name) for name in names}

    def compiled_call(**options):
        torch._dynamo.reset()
        for name in names:
            monkeypatch.setattr(ops, name, torch.compile(originals[name], dynamic=False, **options))
        return call()

    with pytest.raises(Exception) as compiled_error:
        compiled_call(fullgraph=True)
    if str(eager.value) in str(compiled_error.value) or not _DYNAMO_DROPS_MESSAGES:
        assert str(eager.value) in str(compiled_error.value)
    else:
        # Older Dynamo reports an exception raised in traced Python code (the functions' own
        # argument checks) as "Observed exception" without its message under fullgraph=True.
        assert "Observed exception" in str(compiled_error.value)
    with pytest.raises(type(eager.value)) as graph_break:
        compiled_call()
    assert type(graph_break.value) is type(eager.value), repr(graph_break.value)
    assert str(graph_break.value) == str(eager.value)


def check_meta_refuses_like_eager(monkeypatch, name: str, call) -> None:
    """`call()` (which builds bad input eagerly and calls `torchkit.ops.<name>`) raises the
    same exception, type and message, with its tensors moved to the meta device: there only
    the fake kernel runs, so it must refuse what the kernel refuses (a device-mismatch case
    is left out: on meta, every tensor shares the device)."""
    with pytest.raises(Exception) as eager:
        call()
    if "must be on the same device" in str(eager.value):
        pytest.skip("on the meta device every tensor shares the device")
    original = getattr(ops, name)

    def on_meta(*args, **kwargs):
        def meta(v):
            return v.to("meta") if torch.is_tensor(v) else v

        return original(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})

    monkeypatch.setattr(ops, name, on_meta)
    with pytest.raises(type(eager.value)) as on_meta_error:
        call()
    assert str(on_meta_error.value) == str(eager.value)


def check_cuda_matches_cpu(fn, *inputs, differentiable=None, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """fn on CUDA copies of `inputs` agrees with fn on the CPU tensors: the output and, for one
    random upstream gradient, the gradients of the inputs at the positions `differentiable`
    (default: every floating tensor). The two backends' kernels are separate code, so this is
    the check that they compute the same function; a NaN must be NaN on both."""
    if differentiable is None:
        differentiable = [i for i, x in enumerate(inputs) if torch.is_tensor(x) and x.is_floating_point()]

    def prepare(i, x, device):
        return x.detach().to(device).requires_grad_(i in differentiable) if torch.is_tensor(x) else x

    cpu = [prepare(i, x, "cpu") for i, x in enumerate(inputs)]
    gpu = [prepare(i, x, "cuda") for i, x in enumerate(inputs)]
    out_cpu, out_gpu = fn(*cpu), fn(*gpu)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, atol=atol, rtol=rtol, equal_nan=True)
    g = torch.randn_like(out_cpu)
    leaves_cpu = [x for x in cpu if torch.is_tensor(x) and x.requires_grad]
    leaves_gpu = [x for x in gpu if torch.is_tensor(x) and x.requires_grad]
    grads_cpu = torch.autograd.grad(out_cpu, leaves_cpu, g)
    grads_gpu = torch.autograd.grad(out_gpu, leaves_gpu, g.cuda())
    for a, b in zip(grads_gpu, grads_cpu, strict=False):
        torch.testing.assert_close(a.cpu(), b, atol=atol, rtol=rtol, equal_nan=True)


def child_env() -> dict[str, str]:
    """The environment for a fresh interpreter that imports the same torchkit as this process:
    this process's sys.path as its PYTHONPATH. make compat and make cuda-build test builds that
    live elsewhere, and make gpu-check a build in place that only the working directory finds."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def run_python(
    code: str, *args: str, cwd=None, timeout: float | None = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -c code args...` in a fresh interpreter that imports the same torchkit as this
    process (child_env, updated with `env`), run outside the repository so that the checkout's
    own torchkit/ cannot shadow the build under test."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd or tempfile.gettempdir(),
        env={**child_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torch_only_site(target: Path) -> Path:
    """A folder of links to torch and what torch itself requires (its install_requires
    closure, markers evaluated), nothing else of the development environment: no numpy,
    torchvision, Pillow or packaging."""
    target.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    seen, stack = set(), ["torch"]
    while stack:
        name = canonicalize_name(stack.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                stack.append(requirement.name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if top != "__pycache__" and (site / top).exists() and not (target / top).exists():
                (target / top).symlink_to(site / top)
    return target


def assert_device_side_assert(code: str, message: str) -> None:
    """Python `code` run in a fresh interpreter fails a device-side assertion that says
    `message`. A device-side assert poisons the CUDA context of the process it fires in, so
    tests that trigger one must not share the test process."""
    result = run_python(code, timeout=300)
    output = result.stdout + result.stderr
    assert "device-side assert" in output, output
    assert message in output, output


# The CUDA kernels of cdist and knn do not scale by powers of two yet (issue #31): there,
# as in torch.cdist, float32 squares under- and overflow.
DEVICES_SCALED = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.xfail(reason="CUDA: no power-of-two scaling (#31)")]),
]

# The whole finite range, for ops that scale by powers of two: (dtype, magnitude of the data).
# float32 squares under- or overflow past ~1e±19, float64's past ~1e±154.
EXTREMES = [(torch.float32, s) for s in (1e-38, 1e-30, 1e-22, 1e22, 1e30, 1e37)] + [
    (torch.float64, s) for s in (1e-300, 1e-160, 1e160, 1e300)
]


def extreme_points(n, m, dtype, scale, layout, seed=0):
    """n points of m features around `scale`: 'random' (N(0, 1)·scale), 'clusters'
    (near-duplicates of a point 3·scale away from the origin) or 'spread' (rows whose
    magnitudes span 20 orders of ten towards the middle of the range, so that one set holds
    pairs at both ends)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g, dtype=torch.float64)
    if layout == "clusters":
        x = 3 + 1e-3 * x
    elif layout == "spread":
        x = x * torch.logspace(-20 if scale > 1 else 0, 0 if scale > 1 else 20, n, dtype=torch.float64).unsqueeze(1)
    return (x * scale).to(dtype)


def spanning_points(n, m, dtype, seed=0):
    """n points of m features whose row magnitudes are spread log-uniformly over the dtype's
    whole range (1e-37 … 1e37 in float32, 1e-300 … 1e300 in float64), so that one set holds
    pairs whose distances and squares lie anywhere in it, and beyond it."""
    g = torch.Generator().manual_seed(seed)
    top = 37 if dtype == torch.float32 else 300
    decades = torch.empty(n, 1, dtype=torch.float64).uniform_(-top, top, generator=g)
    return (torch.randn(n, m, generator=g, dtype=torch.float64) * 10.0**decades).to(dtype)


def spanning_points_with_nonfinite_rows(n, m, dtype, seed=0):
    """spanning_points followed by 300 rows of magnitude 1 (a later block of the CPU's
    per-block statistics), one row holding a NaN and one a ±∞ among the spanning ones; and
    the mask of the finite rows. A non-finite row may change only its own distances: never the
    power of two by which the other rows are scaled."""
    ordinary = torch.randn(300, m, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    x = torch.cat([spanning_points(n, m, dtype, seed).double(), ordinary]).to(dtype)
    x[3, m // 2] = float("nan")
    x[n // 2, 0] = -float("inf")
    finite = x.isfinite().all(-1)
    return x, finite


def subnormal_points(device, dtype, exponent):
    """x (1, 2) and y (2, 2), 2^exponent times small integers (exact), with distances
    2^exponent and 16·2^exponent, and the gradients of the sum of both distances: unit
    directions, though grad / d alone overflows where d is subnormal (below 1 / the dtype's
    maximum)."""
    s = math.ldexp(1.0, exponent)
    x = (torch.tensor([[16.0, 0.0]], dtype=torch.float64) * s).to(device, dtype).requires_grad_()
    y = (torch.tensor([[16.0, 1.0], [0.0, 0.0]], dtype=torch.float64) * s).to(device, dtype).requires_grad_()
    return x, y, [[1.0, -1.0]], [[0.0, 1.0], [-1.0, 0.0]]


def exact_squared_distances(x1, x2=None):
    """Σ(a - b)² in numpy's long double (x86's 80-bit format: its exponent range holds the
    squares of any float64), as a long-double array."""
    a = x1.double().cpu().numpy().astype(np.longdouble)
    b = a if x2 is None else x2.double().cpu().numpy().astype(np.longdouble)
    return ((a[..., :, None, :] - b[..., None, :, :]) ** 2).sum(-1)


def assert_close_to_exact(actual, exact, rtol):
    """actual (a tensor) against exact values (long double) rounded to its dtype: within rtol
    relative, or the dtype's smallest subnormal, where the exact value is a finite number of
    the dtype; ±∞ where it is past the dtype's range."""
    info = torch.finfo(actual.dtype)
    got = actual.double().cpu().numpy().astype(np.longdouble)
    big = np.abs(exact) > np.longdouble(info.max)
    assert np.all(np.isposinf(got[big])), "distances past the dtype's range must be inf"
    err = np.abs(got - exact)[~big]
    bound = rtol * np.abs(exact[~big]) + np.longdouble(info.smallest_normal * info.eps)
    worst = np.argmax(err - bound) if err.size else None
    assert err.size == 0 or np.all(err <= bound), (
        f"error {float(err[worst]):.3g} at exact value {float(exact[~big][worst]):.3g} (bound {float(bound[worst]):.3g})"
    )
