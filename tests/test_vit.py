"""``--model vit``: the small Vision Transformer (``parallel.models.vit``) as a model of the registry: its graph,
its replicas, where the strategies cut it (at its children), recomputation and ZeRO-3 bitwise, the CLI with
checkpoints, resume and export, and (slow tier) what it learns on scikit-learn's digits.

The ViT has no BatchNorm, so recomputation and ZeRO-3 (which run the same operators on the same bits) train it
bitwise; that K contexts, stages and micro-batches train the one-context model is proved once, by the conformance
matrix (``tests/test_layouts.py``).
"""
import json
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

from parallel import GluonNet, get_params
from parallel import checkpoint as ckpt
from parallel.models import MODELS, block_names, init_model, init_vit, model_layout, vit
from parallel.models.registry import behaviour_of
from parallel.optim import SGD
from parallel.strategies import Stages, make_strategy
from parallel.train import build_parser, main
from conftest import assert_same_arrays, contexts, easy_dataset, load_benchmark, make_batches, write_idx_files

#: Every test of the fast tier here takes a few seconds; one that hangs fails well before the suite's 600 s.
pytestmark = pytest.mark.timeout(120)

ARRAYS, PARAMETERS = 56, 139018   # the defaults: dim 64, 4 heads, depth 4, MLP 128, 7x7 patches


def _train(strategy, optimizer, sizes=(12, 12, 7)):
    """Steps of ``strategy`` on random batches; its trained arrays and the others."""
    for X, y in make_batches(sizes, seed=1):
        strategy.train_step(X, y, optimizer=optimizer)
    return [p.asnumpy() for p in strategy.params()], [a.asnumpy() for a in strategy.aux()]


def _momentum(zero=0):
    return SGD(0.1, momentum=0.9, zero=zero)


# ---- the network ----------------------------------------------------------------------------------------------

def test_the_forward_gives_ten_scores_an_example_and_the_layout_is_the_blocks():
    net = init_vit(seed=0)
    X = mx.nd.random.uniform(shape=(5, 1, 28, 28))
    assert net(X).shape == (5, 10)
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    assert (len(params), sum(p.data().size for p in params)) == (ARRAYS, PARAMETERS)
    assert all(p.data().dtype == np.float32 for p in params)
    layout = model_layout("vit")
    assert layout.names == tuple(block_names(net)[0]) and layout.aux_names == ()
    assert layout.names[:4] == ("0.cls_token", "0.pos_embedding", "0.proj.weight", "0.proj.bias")
    assert layout.shapes[:3] == ((1, 1, 64), (1, 17, 64), (64, 1, 7, 7))
    assert layout.shapes == tuple(p.shape for p in params)
    assert MODELS["vit"].behaviour.layers(net).count == 6   # patch embedding, 4 blocks, head


def test_the_seed_decides_the_initial_values():
    a, b, c = (get_params(init_vit(seed=s), mx.cpu()) for s in (3, 3, 4))
    assert_same_arrays([[p.asnumpy() for p in a]], [[p.asnumpy() for p in b]])
    assert not np.array_equal(a[0].asnumpy(), c[0].asnumpy())


def test_each_child_takes_one_input_and_gives_one_output_as_a_symbol():
    net = init_vit(seed=0)
    for child in net:
        symbol = child(mx.sym.var("data"))
        assert isinstance(symbol, mx.sym.Symbol) and len(symbol.list_outputs()) == 1
    symbol = net(mx.sym.var("data"))
    _, (shape,), _ = symbol.infer_shape(data=(3, 1, 28, 28))
    assert shape == (3, 10)
    _, (tokens,), _ = net[0](mx.sym.var("data")).infer_shape(data=(3, 1, 28, 28))
    assert tokens == (3, 17, 64)


def test_the_hybridized_block_and_its_graph_compute_what_the_block_does():
    net = init_vit(seed=1)
    X = mx.nd.random.uniform(shape=(4, 1, 28, 28))
    want = net(X).asnumpy()
    net.hybridize()
    np.testing.assert_allclose(net(X).asnumpy(), want, rtol=1e-5, atol=1e-6)
    symbol = net(mx.sym.var("data"))
    args = {p.name: p.data() for p in net.collect_params().values()}
    out = symbol.eval(ctx=mx.cpu(), data=X, **args)[0]
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-5, atol=1e-6)


def test_gluon_net_on_a_replica_computes_what_the_block_does_and_its_gradient():
    net = init_vit(seed=2)
    X, y = make_batches([6], seed=3)[0]
    replica = get_params(net, mx.cpu(1))
    assert len(replica) == ARRAYS and len(replica.aux) == 0
    graph = GluonNet(net)
    assert not graph.has_batchnorm
    np.testing.assert_allclose(graph(X.as_in_context(mx.cpu(1)), replica).asnumpy(), net(X).asnumpy(),
                               rtol=1e-5, atol=1e-6)
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():   # the replica's gradients are the block's
        losses = [loss(graph(X.as_in_context(mx.cpu(1)), replica), y.as_in_context(mx.cpu(1))), loss(net(X), y)]
    autograd.backward(losses)
    trainable = [p for p in net.collect_params().values() if p.grad_req != "null"]
    for array, param in zip(replica, trainable):
        want = param.grad().asnumpy()
        np.testing.assert_allclose(array.grad.asnumpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_a_checkpoints_arrays_rebuild_the_model():
    trained = get_params(init_vit(seed=5), mx.cpu())
    block = init_model("vit", 0, list(trained), [])
    X = mx.nd.random.uniform(shape=(2, 1, 28, 28))
    np.testing.assert_array_equal(block(X).asnumpy(), init_vit(seed=5)(X).asnumpy())
    with pytest.raises(ValueError, match="has 56 trainable arrays, got 55"):
        init_model("vit", 0, list(trained)[:-1], [])
    checked = MODELS["vit"].behaviour.check(list(trained), [])
    assert list(checked) == list(model_layout("vit").names)


def test_the_builder_checks_its_sizes():
    assert len(vit(depth=2)) == 4
    with pytest.raises(ValueError, match="multiple of heads"):
        vit(dim=30, heads=4)
    with pytest.raises(ValueError, match="multiple of patch"):
        vit(patch=5)


# ---- the strategies -------------------------------------------------------------------------------------------

def test_recomputation_is_bitwise_the_whole_network_on_two_contexts():
    initial = init_model("vit", 0)
    segments = behaviour_of(initial).segments(initial)
    assert [len(s.net.names) for s in segments] == [4, 12, 12, 12, 12, 4]   # one block a child
    want = _train(make_strategy("data", init_model("vit", 0), contexts(2)), _momentum())
    got = _train(make_strategy("data", init_model("vit", 0), contexts(2), recompute=True), _momentum())
    assert_same_arrays(got, want)


def test_zero_3_is_bitwise_zero_0_with_the_fused_allreduce_on_two_contexts():
    want = _train(make_strategy("data", init_model("vit", 0), contexts(2), reducer="fused"), _momentum(0))
    got = _train(make_strategy("data", init_model("vit", 0), contexts(2), zero=3), _momentum(3))
    assert_same_arrays(got, want)


@pytest.mark.parametrize("name, k, where", [
    ("pipeline", 2, "2 stages: children 0-2 @ cpu(0) | 3-5 @ cpu(1), 3 micro-batches"),
    ("model", 2, "2 stages: children 0-2 @ cpu(0) | 3-5 @ cpu(1)"),
    ("hybrid", 4, "2 replicas x 2 stages: children 0-2 @ cpu(0),cpu(2) | 3-5 @ cpu(1),cpu(3)"),
])
def test_two_stages_cut_at_the_children_and_say_where(name, k, where):
    """The stages cut the ViT at its children and say so; that they train the one-context model is
    ``test_layouts.py``'s cells "pipeline, GPipe", "model" and "data x pipeline"."""
    layout = Stages(count=2, micro_batches=3 if name == "pipeline" else None)
    strategy = make_strategy(name, init_model("vit", 0), contexts(k), layout)
    assert strategy.describe().startswith(where), strategy.describe()


# ---- the command ----------------------------------------------------------------------------------------------

TRAIN = ["--model", "vit", "--batch-size", "4", "--lr", "0.05", "--momentum", "0.9", "--seed", "2", "--no-progress"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """12 train examples (3 batches of 4 an epoch), 6 test examples."""
    return write_idx_files(str(tmp_path_factory.mktemp("idx")), easy_dataset(num_train=12, num_test=6, seed=4))


def _arrays(directory):
    loaded = ckpt.load_checkpoint(directory, model="vit")
    assert loaded.model == "vit" and len(loaded.aux) == 0
    return dict(zip(model_layout("vit").names, (p.asnumpy() for p in loaded.params)))


def test_the_cli_offers_vit():
    model_flag = build_parser().option("model")
    boundaries = build_parser().option("boundaries")
    assert "vit" in model_flag.choices and "ViT's layers are 0 patch embedding" in boundaries.help


def test_cli_trains_checkpoints_resumes_bitwise_and_exports(data_dir, tmp_path, capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*TRAIN, "--data-dir", data_dir, "--devices", "cpu:2", "--epochs", "2",
                 "--checkpoint-dir", str(straight), "--metrics-json", str(tmp_path / "m.json")]) == 0
    assert main([*TRAIN, "--data-dir", data_dir, "--devices", "cpu:2", "--epochs", "1",
                 "--checkpoint-dir", str(resumed)]) == 0
    assert main([*TRAIN, "--data-dir", data_dir, "--devices", "cpu:2", "--epochs", "2", "--resume",
                 "--checkpoint-dir", str(resumed), "--export", str(tmp_path / "vit")]) == 0
    out = capsys.readouterr().out
    assert "training ViT on the MNIST-format files" in out and "resuming from" in out and "exported ViT" in out
    manifest = json.loads((resumed / ckpt.MANIFEST).read_text())
    assert manifest["model"] == "vit"
    got, want = _arrays(resumed), _arrays(straight)
    assert list(got) == list(want) and len(got) == ARRAYS
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    history = json.loads((tmp_path / "m.json").read_text())
    assert len(history) == 2 and all(np.isfinite(m["train_loss"]) for m in history)
    assert history[-1]["memory"][0]["parameters"] == 4 * PARAMETERS

    net = gluon.SymbolBlock.imports(str(tmp_path / "vit-symbol.json"), ["data"], str(tmp_path / "vit-0000.params"))
    loaded = ckpt.load_checkpoint(resumed)
    block = init_model("vit", 0, loaded.params, loaded.aux)   # another seed: every value replaced
    X = mx.nd.array(np.random.RandomState(3).rand(4, 1, 28, 28))
    want = block(X).asnumpy()
    np.testing.assert_allclose(net(X).asnumpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    arrays = mx.nd.load(str(tmp_path / "vit-0000.params"))
    assert sum(name.startswith("arg:") for name in arrays) == ARRAYS
    assert not any(name.startswith("aux:") for name in arrays)


@pytest.mark.parametrize("layout", [
    ["--devices", "cpu:2", "--recompute"],
    ["--devices", "cpu:2", "--zero", "3"],
    ["--devices", "cpu:2", "--strategy", "pipeline", "--stages", "2", "--micro-batches", "2"],
    ["--devices", "cpu:2", "--strategy", "model", "--boundaries", "3"],
    ["--devices", "cpu:4", "--strategy", "hybrid", "--stages", "2"],
], ids=["recompute", "zero3", "pipeline", "model", "hybrid"])
def test_cli_runs_the_vit_under_each_layout(layout, data_dir, tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main([*TRAIN, "--data-dir", data_dir, "--epochs", "1", *layout, "--metrics-json", str(path)]) == 0
    assert "training ViT" in capsys.readouterr().out
    assert np.isfinite(json.loads(path.read_text())[0]["train_loss"])


# ---- what it learns (slow tier) -------------------------------------------------------------------------------

#: The digits run: one context, AdamW, 20 epochs; its test accuracy must reach DIGITS_ACCURACY.
DIGITS_RUN = ["--model", "vit", "--optimizer", "adamw", "--devices", "cpu:1", "--epochs", "20", "--batch-size", "64",
              "--lr", "0.003", "--wd", "0.05", "--lr-schedule", "cosine", "--warmup-epochs", "1", "--seed", "0",
              "--no-progress"]
DIGITS_ACCURACY = 0.90


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_vit_learns_the_digits(tmp_path, capsys):
    """scikit-learn's 1797 digits at 28x28 (benchmarks/digits_dataset.py: 1500 train, 297 held out): at least 0.90
    test accuracy after 20 epochs of AdamW on one context."""
    digits = load_benchmark("digits_dataset").digits_dataset(num_train=1500, seed=0)
    data_dir = write_idx_files(str(tmp_path), digits)
    path = tmp_path / "m.json"
    start = time.perf_counter()
    assert main([*DIGITS_RUN, "--data-dir", data_dir, "--metrics-json", str(path)]) == 0
    seconds = time.perf_counter() - start
    history = json.loads(path.read_text())
    print(f"ViT on the digits: test accuracy {[m['test_acc'] for m in history]}, {seconds:.0f} s")
    assert len(history) == 20
    assert history[-1]["test_acc"] >= DIGITS_ACCURACY, history[-1]
