"""examples/bcnn_finegrained.py runs and learns (a few steps on small images)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # trains a model: full suite (make test) only
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "bcnn_finegrained.py"


def load_example():
    spec = importlib.util.spec_from_file_location("bcnn_finegrained", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SMALL = ["--image-size", "32", "--train-size", "256", "--val-size", "64", "--batch-size", "16", "--quiet"]


def test_loss_decreases():
    (result,) = load_example().main([*SMALL, "--steps", "40", "--classes", "4"])
    losses = result["losses"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["ncm_accuracy"] <= 1.0
    assert result["classes"] == 4 and "chance 25.0%" in load_example().summary(result)
    assert list(result["recall"]) == [1, 2, 4, 8] and 0.0 <= result["recall"][1] <= result["recall"][8] <= 1.0


def test_covariance_pooling_trains():
    (result,) = load_example().main(
        [*SMALL, "--steps", "30", "--classes", "4", "--pool", "covariance", "--channels", "32"]
    )
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    example = load_example()
    assert example.BCNN(4, example.FUSED, 1, 8, None, "covariance").classifier.in_features == 8 * 9 // 2


def test_reference_run_reports_both():
    results = load_example().main([*SMALL, "--steps", "2", "--reference"])
    assert [r["name"] for r in results] == ["torchkit", "reference"]
    assert all(r["images_per_s"] > 0 for r in results)


def test_help_documents_every_flag(capsys):
    example = load_example()
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in (
        "--data",
        "--weights",
        "--reference",
        "--steps",
        "--batch-size",
        "--rcm-blocks",
        "--compile",
        "--pool",
    ):
        assert flag in text
    options = ("\n" + text).split("\n  -")[1:]
    assert all(option.count("default") <= 1 for option in options), "an option states its default twice"


def test_training_pipeline_shuffles_blocks():
    """The example's default augmentation really moves blocks (a neighbourhood that never
    shuffles would train DCL without its augmentation)."""
    example = load_example()
    args = example.parse_args([*SMALL, "--rcm-p", "1"])  # the default neighbourhood, always applied
    train, *_ = example.make_datasets(args)
    moved = 0
    for i in range(8):
        torch.manual_seed(i)
        augmented, _ = train[i]
        plain = (train.base[i][0].float() / 255 - 0.5) / 0.25
        moved += not torch.allclose(augmented, plain)
    assert moved == 8
