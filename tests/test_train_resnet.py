"""python -m parallel.train --model resnet18: the textbook's ResNet-18 under every strategy, with checkpoints,
resume, export and metrics, on a handful of examples (a ResNet-18 step costs ~0.1-0.3 s per example here).

K contexts train the same ResNet-18 as one: exactly so in float64 (1e-9, test_k_contexts_step_equals_one_context
_in_float64). In float32 the one-step update of ResNet-18 at its N(0, 0.01) initialization is ill-conditioned:
against a float64 reference, gluon's own float32 step is off by up to 8% of an array's update, and K=2 by as
much (measured for this file), so the CLI's float32 runs are compared to float32's accuracy, not to 1e-5.
"""
import json
import os
import shutil
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

from parallel import checkpoint as ckpt
from parallel.comm import get_params
from parallel.models import init_resnet18
from parallel.step import train_step
from parallel.train import build_parser, main
from parallel.checkpoint import TrainingState
from parallel.data.batches import epoch_seed
from parallel.models import MODELS, init_model, model_layout
from conftest import easy_dataset, write_idx_files, run_process

TRAIN = ["--batch-size", "3", "--lr", "0.05", "--seed", "2", "--no-progress"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """6 train examples (2 batches of 3 per epoch), 3 test examples."""
    return write_idx_files(tmp_path_factory.mktemp("idx"), easy_dataset(num_train=6, num_test=3, seed=4))


def _run(data_dir, *args):
    assert main(["--model", "resnet18", "--data-dir", str(data_dir), *TRAIN, *args]) == 0


def _arrays(directory):
    """A checkpoint's arrays by name: the trainable ones, then the running statistics."""
    loaded = ckpt.load_checkpoint(directory, model="resnet18")
    layout = model_layout("resnet18")
    assert loaded.model == "resnet18"
    return (dict(zip(layout.names, (p.asnumpy() for p in loaded.params))),
            dict(zip(layout.aux_names, (a.asnumpy() for a in loaded.aux))))


def _followed_by_batchnorm(name):
    """The stem's and the residual blocks' conv biases: BatchNorm subtracts them again, so their gradient is
    zero in exact arithmetic and they stay at rounding level (~1e-7 after a few float32 steps), compared absolutely."""
    return name == "0.0.bias" or name.endswith(("conv1.bias", "conv2.bias"))


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """Two epochs on cpu:2 at once, checkpointed, exported, with metrics: the reference of the tests below."""
    out = tmp_path_factory.mktemp("straight")
    _run(data_dir, "--devices", "cpu:2", "--epochs", "2", "--checkpoint-dir", str(out / "ckpt"),
         "--export", str(out / "resnet18"), "--metrics-json", str(out / "m.json"))
    return out


def test_the_cli_offers_the_registrys_models():
    model_flag = build_parser().option("model")
    assert model_flag.choices == list(MODELS) == ["lenet", "resnet18", "vit", "transformer"]


@pytest.mark.slow
def test_a_two_context_run_prints_checkpoints_and_writes_metrics(straight, capsys):
    history = json.loads((straight / "m.json").read_text())
    assert [sorted(m) for m in history] == [['epoch', 'images_per_second', 'memory', 'seconds', 'test_acc',
                                             'train_acc', 'train_loss', 'workers']] * 2
    for row in history[-1]["memory"]:   # 11,175,818 float32 parameters and their gradient on each context
        assert (row["parameters"], row["gradients"], row["gathered_peak"]) == (4 * 11175818, 4 * 11175818, 0)
    assert all(np.isfinite(m["train_loss"]) for m in history)
    manifest = json.loads((straight / "ckpt" / ckpt.MANIFEST).read_text())
    assert manifest["model"] == "resnet18" and manifest["config"]["model"] == "resnet18"
    params, aux = _arrays(straight / "ckpt")
    assert len(params) == 76 and len(aux) == 34
    assert not np.array_equal(aux["0.1.running_mean"], np.zeros_like(aux["0.1.running_mean"]))   # it trained


@pytest.mark.slow
def test_k2_trains_the_one_context_model_to_float32_accuracy(data_dir, tmp_path, capsys):
    """One step of 6 examples on cpu:2 and on cpu:1 (more steps amplify float32's differences chaotically:
    after 4 steps at lr 0.05 they reached half the update)."""
    for k in (1, 2):
        assert main(["--model", "resnet18", "--data-dir", str(data_dir), "--batch-size", "6", "--lr", "0.05",
                     "--seed", "2", "--no-progress", "--devices", f"cpu:{k}", "--epochs", "1",
                     "--checkpoint-dir", str(tmp_path / str(k))]) == 0
    assert "training ResNet-18 on the MNIST-format files" in capsys.readouterr().out
    (one, one_aux), (two, two_aux) = _arrays(tmp_path / "1"), _arrays(tmp_path / "2")
    initial = dict(zip(model_layout("resnet18").names,
                       (p.asnumpy() for p in get_params(init_resnet18(seed=2), mx.cpu()))))
    for name in one:
        if _followed_by_batchnorm(name):
            np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-5, err_msg=name)
    # the update of every other array agrees to float32's accuracy of ResNet-18's gradient (see above)
    moved = [name for name in one if not _followed_by_batchnorm(name)]
    update = np.concatenate([(one[n] - initial[n]).ravel() for n in moved])
    difference = np.concatenate([(two[n] - one[n]).ravel() for n in moved])
    assert np.linalg.norm(difference) < 0.05 * np.linalg.norm(update)
    for name in one_aux:   # the running statistics of the whole batch, on both
        scale = np.abs(one_aux[name]).max()
        np.testing.assert_allclose(two_aux[name], one_aux[name], rtol=0, atol=1e-4 * scale, err_msg=name)


@pytest.mark.slow
def test_k_contexts_step_equals_one_context_in_float64():
    """The invariant itself, where rounding does not hide it: one float64 step of ResNet-18 on 2 and 3
    contexts (shards of 2+1 and 1+1+1 examples, BatchNorm over the whole batch) equals one context's."""
    block = init_resnet18(seed=1)
    block.cast("float64")
    rng = np.random.RandomState(0)
    X = mx.nd.array(rng.rand(3, 1, 28, 28), dtype="float64")
    y = mx.nd.array(rng.randint(0, 10, 3), dtype="float64")
    results = []
    for k in (1, 3):
        ctx_list = [mx.cpu(i) for i in range(k)]
        device_params = [get_params(block, ctx) for ctx in ctx_list]
        train_step(X, y, device_params, ctx_list, 0.05, net=block)
        results.append(([p.asnumpy() for p in device_params[-1]], [a.asnumpy() for a in device_params[-1].aux]))
    for got, want in zip(results[1][0], results[0][0]):   # biases followed by BatchNorm stay at ~1e-16: absolutely
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=max(1e-9 * np.abs(want).max(), 1e-14))
    for got, want in zip(results[1][1], results[0][1]):   # MXNet's BatchNorm keeps its statistics in float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_resume_is_bitwise_the_straight_run_and_resumes_on_another_layout(data_dir, straight, tmp_path, capsys):
    """1 epoch, then --resume --epochs 2 on the same layout: the same arrays, running statistics included,
    bit for bit; resumed on one context instead: the same to float32's accuracy (see above)."""
    _run(data_dir, "--devices", "cpu:2", "--epochs", "1", "--checkpoint-dir", str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    _run(data_dir, "--devices", "cpu:2", "--epochs", "2", "--checkpoint-dir", str(tmp_path / "a"), "--resume",
         "--metrics-json", str(tmp_path / "m.json"))
    assert "resuming from" in capsys.readouterr().out
    for got, want in zip(_arrays(tmp_path / "a"), _arrays(straight / "ckpt")):
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    timeless = [[{k: v for k, v in m.items() if k not in ("seconds", "images_per_second", "memory")} for m in history]
                for history in (json.loads((tmp_path / "m.json").read_text()),
                                json.loads((straight / "m.json").read_text()))]
    assert timeless[0] == timeless[1]

    _run(data_dir, "--devices", "cpu:1", "--epochs", "2", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    got_aux, want_aux = _arrays(tmp_path / "b")[1], _arrays(straight / "ckpt")[1]
    for name in want_aux:
        np.testing.assert_allclose(got_aux[name], want_aux[name], rtol=0, atol=0.05 * np.abs(want_aux[name]).max())


@pytest.mark.slow
def test_the_export_loads_into_gluon_and_predicts_what_the_checkpoint_holds(straight):
    net = gluon.SymbolBlock.imports(str(straight / "resnet18-symbol.json"), ["data"],
                                    str(straight / "resnet18-0000.params"))
    loaded = ckpt.load_checkpoint(straight / "ckpt")
    block = init_model("resnet18", 0, loaded.params, loaded.aux)   # another seed: every value replaced
    X = mx.nd.array(np.random.RandomState(3).rand(4, 1, 28, 28))
    want = block(X).asnumpy()
    np.testing.assert_allclose(net(X).asnumpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    arrays = mx.nd.load(str(straight / "resnet18-0000.params"))
    assert sum(name.startswith("arg:") for name in arrays) == 76
    assert sum(name.startswith("aux:") for name in arrays) == 34
    assert sorted(os.listdir(straight)) == ["ckpt", "m.json", "resnet18-0000.params", "resnet18-symbol.json"]


@pytest.mark.slow
def test_bad_model_exits_2_with_one_line(capsys):
    assert main(["--model", "vgg16", "--dataset", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: argument --model: invalid choice: 'vgg16' (choose from 'lenet', 'resnet18', "
                           "'vit', 'transformer')")


@pytest.mark.slow
@pytest.mark.parametrize("saved, asked", [("lenet", "resnet18"), ("resnet18", "lenet")])
def test_a_checkpoint_of_another_model_is_refused(saved, asked, data_dir, tmp_path, capsys):
    model = init_model(saved, 0)
    if saved == "lenet":
        params, aux = model, []
    else:
        replica = get_params(model, mx.cpu())
        params, aux = list(replica), replica.aux
    state = TrainingState(1, 1, 0.5, 1.0, 0.1, epoch_seed(2, 1), [])
    ckpt.save_checkpoint(tmp_path, params, state, {"model": saved}, aux=aux, model=saved)
    before = sorted(os.listdir(tmp_path))
    status = main(["--model", asked, "--data-dir", str(data_dir), *TRAIN, "--checkpoint-dir", str(tmp_path),
                   "--resume"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {tmp_path}/checkpoint.json: a checkpoint of {saved}, but this run trains "
                          f"{asked}; resume it as a {saved} run")
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--strategy", "model", "--devices", "cpu:2", "--boundaries", "3"],
    ["--strategy", "pipeline", "--devices", "cpu:2", "--micro-batches", "3"],
    ["--strategy", "hybrid", "--devices", "cpu:4", "--stages", "2"],
], ids=["model", "pipeline", "hybrid"])
def test_other_strategies_resume_the_data_checkpoint_and_export(layout, data_dir, straight, tmp_path):
    """Epoch 2 of the straight run under another strategy, from an epoch-1 checkpoint of the data strategy, in a
    process of its own (a crash inside MXNet must fail this test, not end the test run)."""
    _run(data_dir, "--devices", "cpu:2", "--epochs", "1", "--checkpoint-dir", str(tmp_path / "one"))
    command = [sys.executable, "-m", "parallel.train", "--model", "resnet18", "--data-dir", str(data_dir), *TRAIN,
               *layout, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "one"), "--resume",
               "--export", str(tmp_path / "resnet18")]
    result = run_process(command, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exported ResNet-18" in result.stdout
    if "pipeline" not in layout:   # a pipeline's BatchNorm normalises each micro-batch: another model
        got_aux, want_aux = _arrays(tmp_path / "one")[1], _arrays(straight / "ckpt")[1]
        for name in want_aux:
            np.testing.assert_allclose(got_aux[name], want_aux[name], rtol=0,
                                       atol=0.05 * np.abs(want_aux[name]).max())
    net = gluon.SymbolBlock.imports(str(tmp_path / "resnet18-symbol.json"), ["data"],
                                    str(tmp_path / "resnet18-0000.params"))
    assert net(mx.nd.ones((2, 1, 28, 28))).shape == (2, 10)
