"""examples/bcnn_finegrained.py runs and learns (a few steps on small images)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from testing import child_env

pytestmark = pytest.mark.slow  # trains a model: full suite (make test) only
pytest.importorskip("torchvision", reason="the example trains on torchvision datasets and transforms")
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
    text = load_example().summary(result)
    assert result["classes"] == 4 and "chance 25.0%" in text and "recall@1/2/4/8" in text
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


@pytest.mark.parametrize("loss", ["triplet", "supcon"])
def test_metric_learning_mode(loss):
    """--loss trains the embeddings with a pair loss (the classifier untrained, so only the
    nearest-class-mean accuracy and recall@K are reported)."""
    example = load_example()
    (result,) = example.main([*SMALL, "--steps", "30", "--classes", "4", "--loss", loss, "--channels", "32"])
    losses = result["losses"]
    assert len(losses) == 30 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert result["accuracy"] is None and 0.0 <= result["ncm_accuracy"] <= 1.0
    assert list(result["recall"]) == [1, 2, 4, 8]
    text = example.summary(result)
    assert (
        text.startswith("torchkit: 30 steps")
        and "nearest-class-mean accuracy" in text
        and "recall@1/2/4/8" in text
        and "val accuracy" not in text
    )


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
        "--loss",
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


def evaluate_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    example = load_example()
    args = example.parse_args([*SMALL, "--classes", "4", "--channels", "16"])
    _, train_eval, val, classes = example.make_datasets(args)
    torch.manual_seed(0)
    model = example.BCNN(classes, example.FUSED, 1, 16, None)
    result = example.evaluate(model, train_eval, val, classes, example.FUSED, torch.device("cpu"), args, rank, world)
    if rank == 0:
        torch.save(result, out)
    if world > 1:
        dist.barrier()  # no rank tears its connections down while another still talks to it
        dist.destroy_process_group()


def test_evaluation_across_processes_equals_one_process(tmp_path):
    """Under torchrun each process embeds its share of the images; the accuracies, the class
    means and recall@K (torchkit.metrics with group=) come out as one process computes them."""
    import torch.multiprocessing as mp

    evaluate_worker(0, 1, "", str(tmp_path / "one.pt"))
    mp.spawn(evaluate_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "two.pt")), nprocs=2, join=True)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert two["accuracy"] == one["accuracy"] and two["ncm_accuracy"] == pytest.approx(one["ncm_accuracy"], abs=1 / 64)
    assert list(two["recall"]) == [1, 2, 4, 8]
    # Each process embeds its own batches; a convolution's last bits may differ with the batch.
    assert two["recall"] == pytest.approx(one["recall"], abs=1 / 64)


def test_runs_under_torchrun():
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE)]
    run = subprocess.run(
        [*command, *SMALL, "--steps", "2", "--classes", "4", "--channels", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),  # the workers run the example's file, whose folder does not hold torchkit
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torchkit: 2 steps" in run.stdout and "recall@1/2/4/8" in run.stdout, run.stdout
