"""PyTorch's own test inputs for the ops torchkit replaces: the sample inputs of its OpInfo
database (`torch.testing._internal.common_methods_invocations`, what PyTorch's test_ops runs
for every operator) for `cdist` and `nn.functional.cross_entropy`, through the drop-ins,
compared with PyTorch's results and gradients.

Each op runs in a subprocess: importing `torch.testing._internal` freezes `torch.backends`
flags and patches TorchScript for the rest of the process, which the other tests must not see.
"""

from __future__ import annotations

import pytest
from testing import DEVICES, run_python

# Run with `python -c SCRIPT <op> <device>`; prints one summary line, exits 1 on a mismatch.
SCRIPT = r"""
import sys, warnings
import torch
import torch.nn.functional as F
warnings.filterwarnings("ignore")
from torch.testing._internal.common_methods_invocations import op_db
from torchkit import ops

name, device = sys.argv[1], sys.argv[2]
(opinfo,) = [o for o in op_db if o.name == name]
checked, skipped, failures = 0, 0, []

def compare(what, actual, expected, tol):
    try:
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True)
    except AssertionError as e:
        failures.append(f"{what}: {str(e).splitlines()[0]}")

for dtype, tol in ((torch.float32, 1e-4), (torch.float64, 1e-9)):
    for s in opinfo.sample_inputs(device, dtype, requires_grad=True):
        kwargs = dict(s.kwargs)
        if name == "cdist":
            x1, x2 = s.input, s.args[0]
            kwargs.pop("compute_mode", None)  # torchkit is exact in every mode
            if kwargs.pop("p", 2.0) != 2.0:
                skipped += 1  # torchkit's cdist is the Euclidean distance only
                continue
            # The expected values: torch.cdist's exact mode (its matmul mode errs far from the
            # origin, where torchkit does not).
            expected = torch.cdist(x1, x2, compute_mode="donot_use_mm_for_euclid_dist")
            actual = ops.cdist(x1, x2)
            leaves = (x1, x2)
            what = f"cdist {tuple(x1.shape)} {tuple(x2.shape)} {dtype}"
        else:
            x, target = s.input, s.args[0]
            smoothing = kwargs.pop("label_smoothing", 0.0)
            expected = F.cross_entropy(x, target, label_smoothing=smoothing, **kwargs)
            actual = ops.label_smoothing_cross_entropy(
                x, target, kwargs.get("weight"), kwargs.get("ignore_index", -100),
                kwargs.get("reduction", "mean"), smoothing)
            leaves = (x,)
            what = f"cross_entropy {tuple(x.shape)} target {tuple(target.shape)} {target.dtype} {sorted(s.kwargs)} {dtype}"
        compare(what, actual, expected, tol)
        if actual.numel() and actual.requires_grad:
            g = torch.randn_like(actual)
            for a, e in zip(torch.autograd.grad(actual, leaves, g), torch.autograd.grad(expected, leaves, g)):
                compare(what + " (gradient)", a, e, 10 * tol)
        checked += 1

print(f"{name} on {device}: {checked} samples checked, {skipped} skipped, {len(failures)} failed")
print("\n".join(failures[:20]))
sys.exit(1 if failures or checked == 0 else 0)
"""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["cdist", "nn.functional.cross_entropy"])
def test_pytorch_sample_inputs(name, device):
    pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest")
    run = run_python(SCRIPT, name, device, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
