"""Activation recomputation (``--recompute``, ``parallel.models.Recompute``): the same step, bitwise, as the whole
network's, on every path that trains it (one and several contexts, micro-batches, ZeRO, every optimizer), with
BatchNorm's running statistics updated once a step; every block gets its gradient (the first block's input is the
data, off the tape: a block that is not on the tape would silently get none)."""
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from parallel import get_params, init_lenet_params
from parallel.models import MODELS
from parallel.models.lenet import softmax_cross_entropy
from parallel.models.recompute import Recompute, Segment
from parallel.models.registry import behaviour_of
from parallel.optim import SGD, Adam
from parallel.strategies import make_strategy
from parallel.train import main
from conftest import assert_same_arrays, contexts, diagonal, easy_dataset, make_batches, small_resnet, write_idx_files


def _train(initial, k, recompute, optimizer, sizes=(12, 12, 7), accumulate=1):
    """Steps of the data strategy on ``k`` contexts; returns the trained arrays and running statistics."""
    strategy = make_strategy("data", initial, contexts(k), recompute=recompute)
    for X, y in make_batches(sizes, seed=1):
        strategy.train_step(X, y, optimizer=optimizer, accumulate=accumulate)
    return [p.asnumpy() for p in strategy.params()], [a.asnumpy() for a in strategy.aux()]


@pytest.mark.parametrize("k_accumulate, optimizer", diagonal([(1, 1), (2, 1), (3, 1), (2, 3)],
                                                           ["momentum", "adam", "momentum zero 1", "adam zero 2"]))
def test_lenet_recomputed_is_bitwise_the_whole_network(k_accumulate, optimizer):
    k, accumulate = k_accumulate
    def make():
        zero = int(optimizer.split()[-1]) if "zero" in optimizer else 0
        if k == 1:
            zero = 0
        return Adam(0.01, zero=zero) if optimizer.startswith("adam") else SGD(0.1, momentum=0.9, zero=zero)
    want = _train(init_lenet_params(seed=0), k, False, make(), accumulate=accumulate)
    got = _train(init_lenet_params(seed=0), k, True, make(), accumulate=accumulate)
    assert_same_arrays(got, want)
    assert not np.array_equal(got[0][0], init_lenet_params(seed=0)[0].asnumpy())   # it trained


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_block_with_batchnorm_recomputed_is_bitwise_with_its_running_statistics(k):
    """BatchNorm synchronized over the contexts recomputes over the whole batch, and its running statistics are
    updated once a step (the recomputed forward writes scratch copies). On one context the whole network is one
    cached graph and each block another, and MXNet's graphs round BatchNorm's backward differently (a few ulps):
    there the check is float32 rounding, 1e-6 of the model's scale (its largest value) after three steps: a
    convolution's bias before a BatchNorm has no gradient but rounding noise, so its own scale is no yardstick."""
    want = _train(small_resnet(), k, False, SGD(0.1, momentum=0.9))
    got = _train(small_resnet(), k, True, SGD(0.1, momentum=0.9))
    if k > 1:
        assert_same_arrays(got, want)
    else:
        scale = max(np.abs(w).max() for w in want[0])
        for g, w in zip(got[0] + got[1], want[0] + want[1]):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * scale)
    assert got[1] and not np.array_equal(got[1][1], np.ones_like(got[1][1]))   # running variance moved


def test_the_blocks_of_a_gluon_network_are_its_composite_children():
    segments = behaviour_of(small_resnet()).segments(small_resnet())
    # the stem whole, each residual block of the stage, then pooling joined to the dense head
    assert [len(s.net.names) for s in segments] == [4, 8, 10, 2]
    assert [(s.first, s.stop) for s in segments] == [(0, 4), (4, 12), (12, 22), (22, 24)]


@pytest.mark.slow
def test_resnet18_recomputed_is_bitwise_on_two_contexts():
    initial = MODELS["resnet18"].behaviour.init(seed=0)
    segments = behaviour_of(initial).segments(initial)
    assert len(segments) == 10   # stem, 8 residual blocks, pooling + dense
    want = _train(MODELS["resnet18"].behaviour.init(seed=0), 2, False, SGD(0.05, momentum=0.9), sizes=(16, 16))
    got = _train(MODELS["resnet18"].behaviour.init(seed=0), 2, True, SGD(0.05, momentum=0.9), sizes=(16, 16))
    assert_same_arrays(got, want)


def test_every_parameter_gets_its_gradient_through_net_backward():
    """The first block's input is data, off the tape: its parameters still get their gradient, equal to the whole
    network's; a plain autograd.backward reaches only the last block, which is why the step calls net.backward."""
    lenet = MODELS["lenet"].behaviour
    X, y = make_batches([8], seed=2)[0]
    grads = {}
    for how in ("whole", "recomputed", "autograd only"):
        params = get_params(init_lenet_params(seed=0), mx.cpu())
        net = lenet.net(None) if how == "whole" else Recompute(lenet.net(None), lenet.segments(init_lenet_params()))
        with autograd.record():
            loss = softmax_cross_entropy(net(X, params), y)
        (net.backward if how == "recomputed" else autograd.backward)([loss])
        grads[how] = [p.grad.asnumpy().copy() for p in params]
    for g, w in zip(grads["recomputed"], grads["whole"]):
        assert np.abs(w).max() > 0
        np.testing.assert_array_equal(g, w)
    assert all(np.abs(g).max() == 0 for g in grads["autograd only"][:6])   # layers 1-3 untouched


def test_backward_without_a_recorded_forward_is_refused():
    lenet = MODELS["lenet"].behaviour
    net = Recompute(lenet.net(None), lenet.segments(init_lenet_params()))
    with pytest.raises(RuntimeError, match="follows a forward recorded"):
        net.backward([mx.nd.ones((1,))])


def test_segments_must_follow_each_other():
    with pytest.raises(ValueError, match="do not follow each other"):
        Recompute(None, [Segment(None, 0, 2), Segment(None, 3, 4)])
    with pytest.raises(ValueError, match="segments is empty"):
        Recompute(None, [])


@pytest.mark.parametrize("strategy", ["data", "pipeline"])
def test_make_strategy_checks_recompute(strategy):
    with pytest.raises(TypeError, match="recompute must be True or False"):
        make_strategy(strategy, init_lenet_params(), contexts(2), recompute="yes")


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_cli_recompute_trains_the_same_curve(tmp_path, capsys):
    data_dir = write_idx_files(str(tmp_path), easy_dataset(num_train=256, num_test=64, seed=1))
    curves = []
    for extra in ([], ["--recompute"]):
        path = tmp_path / f"m{len(extra)}.json"
        assert main(["--data-dir", data_dir, "--devices", "cpu:2", "--epochs", "2", "--batch-size", "32",
                     "--momentum", "0.9", "--lr", "0.05", "--metrics-json", str(path), "--no-progress", *extra]) == 0
        curves.append([{k: m[k] for k in ("train_loss", "train_acc", "test_acc")}
                       for m in json.loads(path.read_text())])
    assert "activations recomputed in backward (4 blocks)" in capsys.readouterr().out
    assert curves[0] == curves[1]


def test_cli_recompute_with_the_pipeline_trains_the_same_curve(tmp_path, capsys):
    """Recomputation is a plug-in of every layout: the pipeline's stages recompute their blocks (each a LeNet
    layer) and train the curve the pipeline trains without."""
    data_dir = write_idx_files(str(tmp_path), easy_dataset(num_train=128, num_test=32, seed=1))
    curves = []
    for extra in ([], ["--recompute"]):
        path = tmp_path / f"p{len(extra)}.json"
        assert main(["--data-dir", data_dir, "--devices", "cpu:2", "--strategy", "pipeline", "--epochs", "1",
                     "--batch-size", "32", "--metrics-json", str(path), "--no-progress", *extra]) == 0
        curves.append([{k: m[k] for k in ("train_loss", "train_acc", "test_acc")}
                       for m in json.loads(path.read_text())])
    assert "activations recomputed in backward" in capsys.readouterr().out
    assert curves[0] == curves[1]
