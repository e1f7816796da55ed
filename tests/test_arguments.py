"""Every public function refuses an argument of the wrong type with a TypeError (a Python int
past int64 with a ValueError) that names the function and the argument, eagerly and under
torch.compile, before anything reaches the dispatcher (whose own errors name neither the
function nor, for None, the argument)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from testing import check_compiled_refuses_like_eager

import torchkit.nn
from torchkit import metrics, ops

x4 = torch.randn(2, 3, 4, 4)
x2 = torch.randn(5, 3)
labels = torch.tensor([0, 0, 1, 1, 2])

# function name -> (the function, valid keyword arguments)
CALLS = {
    "bilinear_pool": (ops.bilinear_pool, dict(x=x4, y=x4, sqrt_eps=1e-5, l2_eps=1e-12)),
    "cdist": (ops.cdist, dict(x1=x2, x2=x2, squared=False)),
    "covariance_pool": (ops.covariance_pool, dict(x=x4, iterations=5, sqrt=True, triu=True)),
    "knn": (ops.knn, dict(query=x2, gallery=x2, k=2, squared=False)),
    "label_smoothing_cross_entropy": (
        ops.label_smoothing_cross_entropy,
        dict(
            input=x2,
            target=labels,
            weight=torch.ones(3),
            ignore_index=-100,
            reduction="mean",
            label_smoothing=0.1,
            exclude_target=False,
        ),
    ),
    "permute_blocks": (ops.permute_blocks, dict(x=x4, permutation=torch.arange(4).repeat(2, 1), num_blocks=2)),
    "region_confusion": (ops.region_confusion, dict(x=x4, num_blocks=2, neighbourhood=2, generator=None)),
    "recall_at_k": (metrics.recall_at_k, dict(embeddings=x2, labels=labels, ks=(1, 2))),
    "map_at_r": (metrics.map_at_r, dict(embeddings=x2, labels=labels)),
}

# argument -> its kind, for each function's arguments
KINDS = {
    "tensor": ["x", "x1", "query", "input", "target", "permutation", "embeddings", "labels"],
    "optional_tensor": ["y", "x2", "gallery", "weight"],
    "int": ["iterations", "k", "ignore_index", "num_blocks", "neighbourhood"],
    "float": ["sqrt_eps", "l2_eps", "label_smoothing"],
    "bool": ["squared", "sqrt", "triu", "exclude_target"],
}
KIND_OF = {name: kind for kind, names in KINDS.items() for name in names}

# kind -> (bad value, what the message says the argument must be)
BAD_VALUES = {
    "tensor": [(None, "a Tensor"), (1.5, "a Tensor"), ([1, 2], "a Tensor"), (np.ones(3), "a Tensor")],
    "optional_tensor": [(1.5, "a Tensor or None"), ("x", "a Tensor or None"), ([1.0], "a Tensor or None")],
    "int": [
        (None, "an int"),
        (1.5, "an int"),
        (True, "an int"),
        ("2", "an int"),
        (torch.ones(2, dtype=torch.long), "an int"),
    ],
    "float": [
        (None, "a float"),
        ("0.1", "a float"),
        ([0.1], "a float"),
        (True, "a float"),
        (1j, "a float"),
        (torch.tensor(False), "a float"),
    ],
    "bool": [(None, "a bool"), (1, "a bool"), (1.0, "a bool"), (torch.tensor(True), "a bool")],
}

CASES = [
    pytest.param(op, arg, value, must, id=f"{op}-{arg}-{type(value).__name__}")
    for op, (_, kwargs) in CALLS.items()
    for arg in kwargs
    if arg in KIND_OF
    for value, must in BAD_VALUES[KIND_OF[arg]]
]


def call_with(op: str, arg: str, value):
    fn, kwargs = CALLS[op]
    return fn(**{**kwargs, arg: value})


@pytest.mark.parametrize("op", list(CALLS))
def test_the_valid_arguments_run(op):
    fn, kwargs = CALLS[op]
    fn(**kwargs)


@pytest.mark.bad_input
@pytest.mark.parametrize("op,arg,value,must", CASES)
def test_wrong_type_is_a_type_error_that_names_the_argument(op, arg, value, must):
    with pytest.raises(TypeError, match=rf"^{op}: {arg} must be {must}"):
        call_with(op, arg, value)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "op,arg", [(op, arg) for op, (_, kw) in CALLS.items() for arg in kw if KIND_OF.get(arg) == "int"]
)
def test_int_past_int64_is_a_value_error(op, arg):
    with pytest.raises(ValueError, match=rf"^{op}: {arg} must fit in int64, got {2**70}"):
        call_with(op, arg, 2**70)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "op,arg", [(op, arg) for op, (_, kw) in CALLS.items() for arg in kw if KIND_OF.get(arg) == "float"]
)
def test_int_past_float64_is_a_value_error(op, arg):
    """float(10**400) raises Python's bare OverflowError, naming neither the op nor the argument."""
    with pytest.raises(ValueError, match=rf"^{op}: {arg} must fit in a float \(float64\), got an int of 401 digits"):
        call_with(op, arg, 10**400)
    with pytest.raises(ValueError, match=rf"^{op}: {arg} must fit in a float"):
        call_with(op, arg, -(10**400))


def test_ints_and_floats_take_numpy_scalars_and_0d_tensors():
    expected = ops.label_smoothing_cross_entropy(x2, labels, ignore_index=1, label_smoothing=0.25)
    for ignore_index, smoothing in [(np.int32(1), np.float32(0.25)), (torch.tensor(1), torch.tensor(0.25)), (1, 0.25)]:
        got = ops.label_smoothing_cross_entropy(x2, labels, ignore_index=ignore_index, label_smoothing=smoothing)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert ops.knn(x2, k=np.int64(2))[1].shape == (5, 2)
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16):
        assert ops.knn(x2, k=torch.tensor(2, dtype=dtype))[1].shape == (5, 2)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "op,arg", [(op, arg) for op, (_, kw) in CALLS.items() for arg in kw if KIND_OF.get(arg) in ("int", "float")]
)
def test_a_0d_meta_tensor_is_refused_naming_the_argument(op, arg):
    """A meta tensor holds no value: its item() error would name neither the op nor the argument."""
    must = "an int" if KIND_OF[arg] == "int" else "a float"
    value = torch.tensor(2 if must == "an int" else 0.5, device="meta")
    with pytest.raises(TypeError, match=rf"^{op}: {arg} must be {must}, got a meta tensor, which holds no value"):
        call_with(op, arg, value)


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")
def test_0d_tensors_that_do_not_read_back_as_numbers_are_refused():
    # A quantized scalar reads back dequantized (1.5 would pass as k = 1); bits dtypes do not
    # read back at all.
    for value in (
        torch.quantize_per_tensor(torch.tensor(1.5), 0.5, 0, torch.qint8),
        torch.empty((), dtype=torch.bits8),
    ):
        with pytest.raises(
            TypeError, match=rf"^knn: k must be an int, got Tensor of shape \(\) and dtype {value.dtype}$"
        ):
            ops.knn(x2, k=value)
        with pytest.raises(TypeError, match=r"^label_smoothing_cross_entropy: label_smoothing must be a float, got"):
            ops.label_smoothing_cross_entropy(x2, labels, label_smoothing=value)


@pytest.mark.parametrize("ks", [None, 4, torch.tensor(4), "14"])
def test_recall_ks_must_be_an_iterable_of_ints(ks):
    with pytest.raises(TypeError, match=r"^recall_at_k: ks must be an iterable of ints such as \(1, 2, 4, 8\)"):
        metrics.recall_at_k(x2, labels, ks)


def test_recall_ks_may_be_a_tensor_of_ints():
    assert metrics.recall_at_k(x2, labels, torch.tensor([1, 2])) == metrics.recall_at_k(x2, labels, (1, 2))


def test_a_tensor_in_a_message_shows_its_shape_not_its_values():
    with pytest.raises(TypeError, match=r"k must be an int, got Tensor of shape \(1000,\) and dtype torch.int64$"):
        ops.knn(x2, k=torch.ones(1000, dtype=torch.long))


COMPILED = [
    ("cdist", lambda: ops.cdist(None)),
    ("cdist", lambda: ops.cdist(x2, 1.5)),
    ("knn", lambda: ops.knn(x2, "gallery", 2)),
    ("bilinear_pool", lambda: ops.bilinear_pool(x4, sqrt_eps="1e-5")),
    ("covariance_pool", lambda: ops.covariance_pool([x4])),
    ("label_smoothing_cross_entropy", lambda: ops.label_smoothing_cross_entropy(x2, labels, 0.1)),
    ("label_smoothing_cross_entropy", lambda: ops.label_smoothing_cross_entropy(x2, labels, exclude_target=1)),
    ("permute_blocks", lambda: ops.permute_blocks(x4, [0, 1, 2, 3], 2)),
    ("bilinear_pool", lambda: ops.bilinear_pool(x4, sqrt_eps=10**400)),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("name,call", COMPILED, ids=[f"{name}-{i}" for i, (name, _) in enumerate(COMPILED)])
def test_wrong_type_under_compile(monkeypatch, name, call):
    check_compiled_refuses_like_eager(monkeypatch, [name], call)


MODULES = [
    (lambda: torchkit.nn.CDist(1), r"^CDist: squared must be a bool, got int 1"),
    (lambda: torchkit.nn.BilinearPool2d("1e-5"), r"^BilinearPool2d: sqrt_eps must be a float, got str '1e-5'"),
    (lambda: torchkit.nn.BilinearPool2d(l2_eps=None), r"^BilinearPool2d: l2_eps must be a float, got NoneType None"),
    (lambda: torchkit.nn.CovariancePool2d(sqrt=None), r"^CovariancePool2d: sqrt must be a bool, got NoneType None"),
    (lambda: torchkit.nn.CovariancePool2d(triu=0), r"^CovariancePool2d: triu must be a bool, got int 0"),
    (
        lambda: torchkit.nn.LabelSmoothingCrossEntropy(label_smoothing="0.1"),
        r"^LabelSmoothingCrossEntropy: label_smoothing must be a float, got str '0.1'",
    ),
    (
        lambda: torchkit.nn.LabelSmoothingCrossEntropy(exclude_target=1),
        r"^LabelSmoothingCrossEntropy: exclude_target must be a bool, got int 1",
    ),
    (
        lambda: torchkit.nn.LabelSmoothingCrossEntropy(ignore_index=1.0),
        r"^LabelSmoothingCrossEntropy: ignore_index must be an int, got float 1.0",
    ),
    (
        lambda: torchkit.nn.LabelSmoothingCrossEntropy(reduction=None),
        r"^LabelSmoothingCrossEntropy: reduction must be 'none', 'mean' or 'sum', got NoneType None",
    ),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("make,match", MODULES)
def test_modules_check_their_settings_when_built(make, match):
    with pytest.raises(TypeError, match=match):
        make()


@pytest.mark.bad_input
def test_reduction_must_be_a_string():
    with pytest.raises(
        TypeError, match=r"^label_smoothing_cross_entropy: reduction must be 'none', 'mean' or 'sum', got int 1$"
    ):
        ops.label_smoothing_cross_entropy(x2, labels, reduction=1)


# Raw ops: every number and flag argument is declared Scalar, so that the kernels see the type
# the caller passed and refuse what the public functions refuse (a declared float, int or bool
# would take a bool, a one-element tensor or None without a word). The dispatcher refuses a
# tensor and None itself, naming the argument; the kernels (and on meta tensors the fake
# kernels) refuse the rest with the public functions' TypeError.
def _raw_calls():
    x, target = torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])
    out, norm = torch.ops.torchkit.bilinear_pool(x4, None, 1e-5, 1e-12)
    _, lse, total = torch.ops.torchkit.label_smoothing_cross_entropy(x, target, None, -100, "mean", 0.1, False)
    cov, sigma, scale = torch.ops.torchkit.covariance_pool(x4, 5, True, True)
    dist = torch.ops.torchkit.cdist(x, None, False)
    R = torch.ops.torchkit
    # (op name as its messages print it, the raw op, its valid arguments, {position: (name, kind)})
    return [
        ("bilinear_pool", R.bilinear_pool, [x4, None, 1e-5, 1e-12], {2: ("sqrt_eps", "float"), 3: ("l2_eps", "float")}),
        (
            "bilinear_pool",
            R._bilinear_pool_backward,
            [torch.ones_like(out), x4, None, out, norm, 1e-5, 1e-12, [True, False]],
            {5: ("sqrt_eps", "float"), 6: ("l2_eps", "float")},
        ),
        ("cdist", R.cdist, [x, None, False], {2: ("squared", "bool")}),
        (
            "cdist",
            R._cdist_backward,
            [torch.ones_like(dist), x, None, dist, False, [True, False]],
            {4: ("squared", "bool")},
        ),
        ("knn", R.knn, [x, None, 2, False], {2: ("k", "int"), 3: ("squared", "bool")}),
        (
            "covariance_pool",
            R.covariance_pool,
            [x4, 5, True, True],
            {1: ("iterations", "int"), 2: ("sqrt", "bool"), 3: ("triu", "bool")},
        ),
        (
            "covariance_pool",
            R._covariance_pool_backward,
            [torch.ones_like(cov), x4, sigma, scale, 5, True, True],
            {4: ("iterations", "int"), 5: ("sqrt", "bool"), 6: ("triu", "bool")},
        ),
        (
            "label_smoothing_cross_entropy",
            R.label_smoothing_cross_entropy,
            [x, target, None, -100, "mean", 0.1, False],
            {3: ("ignore_index", "int"), 5: ("label_smoothing", "float"), 6: ("exclude_target", "bool")},
        ),
        (
            "label_smoothing_cross_entropy",
            R._label_smoothing_cross_entropy_backward,
            [torch.tensor(1.0), x, target, None, lse, total, -100, "mean", 0.1, False],
            {6: ("ignore_index", "int"), 8: ("label_smoothing", "float"), 9: ("exclude_target", "bool")},
        ),
        ("permute_blocks", R.permute_blocks, [x4, torch.arange(4).repeat(2, 1), 2], {2: ("num_blocks", "int")}),
    ]


# kind -> (bad value, the kernel's "must be ..." or None where the dispatcher refuses it)
RAW_BAD_VALUES = {
    "float": [
        (True, "a float, got bool True"),
        (1j, "a float, got complex"),
        (torch.tensor([1e-5]), None),
        (None, None),
    ],
    "int": [(True, "an int, got bool True"), (2.0, "an int, got float 2.0"), (torch.tensor(2), None), (None, None)],
    "bool": [(1, "a bool, got int 1"), (0.5, "a bool, got float 0.5"), (torch.tensor(True), None), (None, None)],
}
RAW_CASES = [
    pytest.param(i, position, value, must, device, id=f"{raw}-{name}-{type(value).__name__}-{device}")
    for i, (_, raw, _, scalars) in enumerate(_raw_calls())
    for position, (name, kind) in scalars.items()
    for value, must in RAW_BAD_VALUES[kind]
    for device in ("cpu", "meta")
]


@pytest.mark.bad_input
@pytest.mark.parametrize("index,position,value,must,device", RAW_CASES)
def test_raw_ops_refuse_what_the_functions_refuse(index, position, value, must, device):
    op, raw, args, scalars = _raw_calls()[index]
    name = scalars[position][0]
    args = [a.to(device) if torch.is_tensor(a) else a for a in args]
    raw(*args)  # the valid call runs
    args[position] = value
    if must is None:
        with pytest.raises(RuntimeError, match=rf"for argument '{name}' but instead found type"):
            raw(*args)
    else:
        with pytest.raises(TypeError, match=rf"^{op}: {name} must be {re.escape(must)}"):
            raw(*args)


def test_raw_ops_take_an_int_for_a_float():
    assert torch.equal(
        torch.ops.torchkit.bilinear_pool(x4, None, 0, 1)[0], torch.ops.torchkit.bilinear_pool(x4, None, 0.0, 1.0)[0]
    )
