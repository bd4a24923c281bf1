"""Layers that say how they are split (``parallel.models.layers``), their shard specs (``parallel.shard``) and the
segment tape (``parallel.comm.tensor.SegmentTape``): the ViT and the row Transformer run on T = 2, 3, 4 ranks by
``run_ranks`` compute what the ordinary gluon block computes on one context (logits, every gradient) to float32
rounding, with Megatron's collectives; each layer's ranks mode is its gluon base class's arithmetic; specs cut and
join arrays exactly; the tape's rules (an input read by several segments, heads that are a collective's output or
a leaf, a parameter read by two segments).

Tolerances are relative to each array's scale (``max |a - b| / max |b|``), never recorded floats: oneDNN sums in
another order on another CPU."""
import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, strategies as st
from mxnet import autograd, gluon
from mxnet.gluon import nn

from parallel.comm.tensor import SegmentTape
from parallel.models import MODELS, init_transformer, init_vit
from parallel.models.layers import (ColumnParallelDense, ParallelPatchEmbedding, Ranks, RanksF, RowParallelDense,
                                    joined_arrays, local_arrays, most_ranks, replicate_ranks, run_ranks, shard_specs)
from parallel.models.registry import behaviour_of
from parallel.models.vit import TransformerBlock
from parallel.shard import Replicated, Split
from parallel.train import main
from parallel.validate import BadType, BadValue
from conftest import contexts, easy_dataset, make_batches, small_resnet, write_idx_files

pytestmark = pytest.mark.timeout(120)

#: The most a run on T ranks may differ from one context, relative to each array's scale. Measured here: at most
#: 9.7e-7 (the ViT's gradients), 5.3e-7 (its logits).
RTOL = 1e-5


def _relative(got, want):
    got, want = (a.asnumpy() if isinstance(a, mx.nd.NDArray) else np.asarray(a) for a in (got, want))
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(np.abs(want).max(), np.finfo(np.float32).tiny))


def _trainable(net):
    return [p for p in net.collect_params().values() if p.grad_req != "null"]


# ---- the two models on T ranks against one context --------------------------------------------------------------

BUILDERS = {"vit": init_vit, "transformer": init_transformer}
BATCH = 5


@pytest.fixture(scope="module")
def one_context():
    """Each model's logits and gradients on one context, the ordinary gluon block (softmax cross-entropy)."""
    out = {}
    X, y = make_batches([BATCH], seed=3)[0]
    for name, build in BUILDERS.items():
        net = build(seed=1)
        with autograd.record():
            logits = net(X)
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(logits, y)
        loss.backward()
        out[name] = (X, y, logits.asnumpy(), [p.grad().asnumpy() for p in _trainable(net)])
    return out


def _megatron(name, T):
    """Megatron's count: f before each attention, each MLP and the classifier; g after each attention, each MLP
    and (the ViT's) patch projection; the elements f sums backward and g forward, on every rank. (The ViT's patch
    projection has an f too, on the images: no gradient flows to them, so its backward sums nothing.)"""
    if name == "vit":
        depth, tokens, dim = 4, 17, 64
        return 2 * depth + 2, 2 * depth + 1, T * (4 * depth * BATCH * tokens * dim + BATCH * 16 * dim + BATCH * dim)
    depth, tokens, dim = 2, 28, 32
    return 2 * depth + 1, 2 * depth, T * (4 * depth * BATCH * tokens * dim + BATCH * dim)


@pytest.mark.parametrize("T", [2, 3, 4])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_model_on_T_ranks_is_the_one_context_model(name, T, one_context):
    """Training (recorded, every rank's loss a head) and evaluation: the logits on every rank, and every trainable
    array's gradient joined over the ranks with its spec, within 1e-5 of its scale of one context's; each
    replicated array's gradient the same bits on every rank; Megatron's collectives. The block is hybridized:
    ``run_ranks`` runs its blocks' code, not gluon's cached graph."""
    X, y, want_logits, want_grads = one_context[name]
    net = BUILDERS[name](seed=1)
    net.hybridize()
    parts = replicate_ranks(net, contexts(T))
    tape = SegmentTape()
    with autograd.record():
        out = run_ranks(net, X, parts, tape)
        losses = [gluon.loss.SoftmaxCrossEntropyLoss()(logits, y.as_in_context(logits.context))
                  for logits in out.arrays]
    tape.backward(losses)
    assert len(out) == T and [a.context for a in out.arrays] == contexts(T)
    for logits in out.arrays:
        assert _relative(logits, want_logits) <= RTOL
    grads = joined_arrays(net, [[a.grad for a in rank] for rank in parts])
    worst = max(_relative(got, want) for got, want in zip(grads, want_grads))
    assert worst <= RTOL, worst
    specs = list(shard_specs(net).values())
    for i, spec in enumerate(specs):
        if isinstance(spec, Replicated):
            for rank in parts[1:]:
                np.testing.assert_array_equal(rank[i].grad.asnumpy(), parts[0][i].grad.asnumpy())
    f, g, elements = _megatron(name, T)
    assert (tape.calls["f"], tape.calls["g"]) == (f, g) and tape.allreduced == elements
    evaluated = run_ranks(net, X, parts)   # outside record(): nothing kept
    assert all(_relative(logits, want_logits) <= RTOL for logits in evaluated.arrays)


def test_the_models_split_over_their_heads():
    """The specs the layers declare: the ViT's fused q, k, v rows by heads in 3 parts, the projection's columns by
    heads, the MLP's units, the patch projection's pixels, the classes; the rest replicated. ``most_ranks`` is the
    registry's ``tensor`` for both models."""
    net = init_vit(seed=0)
    specs = dict(zip(MODELS["vit"].behaviour.layout().names, shard_specs(net).values()))
    assert specs["1.attention.qkv.weight"] == specs["1.attention.qkv.bias"] == Split(0, parts=3, unit=16)
    assert specs["1.attention.proj.weight"] == Split(1, unit=16) and specs["1.attention.proj.bias"] == Replicated()
    assert specs["1.hidden.weight"] == Split(0) and specs["1.out.weight"] == Split(1)
    assert specs["0.proj.weight"] == Split(1, flatten=True) and specs["5.dense.bias"] == Split(0)
    assert specs["0.cls_token"] == specs["1.norm1.gamma"] == Replicated()
    shapes = {name: Split(0, 3, 16).local_shape((192, 64), 1, 3) for name in ["qkv"]}
    assert shapes["qkv"] == (48, 64)   # 4 heads over 3 ranks: 2, 1, 1
    for name, build in BUILDERS.items():
        block = build(seed=0)
        assert most_ranks(block) == MODELS[name].tensor == 4
        assert MODELS[name].behaviour.shard_specs(block) == shard_specs(block)
    with pytest.raises(BadValue, match="T=5 ranks cannot all hold a part"):
        local_arrays(net, [p.data() for p in _trainable(net)], 0, 5)


def test_models_without_parallel_layers_are_replicated():
    lenet = MODELS["lenet"].behaviour
    assert set(lenet.shard_specs(lenet.init(0)).values()) == {Replicated()}
    resnet = small_resnet()
    assert set(behaviour_of(resnet).shard_specs(resnet).values()) == {Replicated()}
    assert most_ranks(resnet) is None


def test_the_transformer_trains_through_the_cli(tmp_path, capsys):
    """``--model transformer``: a model of the registry, two contexts, an export."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=32, num_test=8, seed=3))
    assert main(["--model", "transformer", "--data-dir", str(data_dir), "--devices", "cpu:2", "--epochs", "1",
                 "--batch-size", "8", "--no-progress", "--export", str(tmp_path / "net")]) == 0
    out = capsys.readouterr().out
    assert "training Transformer" in out and "exported Transformer" in out
    net = gluon.SymbolBlock.imports(str(tmp_path / "net-symbol.json"), ["data"], str(tmp_path / "net-0000.params"))
    assert net(mx.nd.zeros((2, 1, 28, 28))).shape == (2, 10)


# ---- each layer: its base class in ordinary mode, the same arithmetic on ranks -----------------------------------

def _pair(layer, base, shape, seed=0):
    """``layer`` and its gluon ``base`` initialized to the same values, shapes known from an input of ``shape``."""
    mx.random.seed(seed)
    layer.initialize(mx.init.Uniform(0.5))
    base.initialize()
    X = mx.nd.random.uniform(-1, 1, shape=shape)
    layer(X), base(X)
    for mine, theirs in zip(_trainable(layer), _trainable(base)):
        theirs.set_data(mine.data())
    return X


LAYERS = {
    "column": lambda: (ColumnParallelDense(18, parts=3, unit=2, activation="relu", flatten=False, in_units=5),
                       nn.Dense(18, activation="relu", flatten=False, in_units=5), (4, 3, 5)),
    "column gathered": lambda: (ColumnParallelDense(7, gather_output=True, in_units=6),
                                nn.Dense(7, in_units=6), (4, 2, 3)),
    "row": lambda: (RowParallelDense(5, parts=2, unit=3, flatten=False, in_units=18),
                    nn.Dense(5, flatten=False, in_units=18), (4, 3, 18)),
    "patches": lambda: (ParallelPatchEmbedding(4, (3, 2), in_channels=2),
                        nn.Conv2D(4, kernel_size=(3, 2), strides=(3, 2), in_channels=2), (3, 2, 11, 9)),
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_ordinary_mode_is_the_base_class_bit_for_bit(kind):
    layer, base, shape = LAYERS[kind]()
    X = _pair(layer, base, shape)
    np.testing.assert_array_equal(layer(X).asnumpy(), base(X).asnumpy())
    layer.hybridize()
    base.hybridize()
    np.testing.assert_array_equal(layer(X).asnumpy(), base(X).asnumpy())


def _rank_inputs(layer, X, T):
    """A row-parallel layer reads each rank's part of its input (as the column-parallel layer before it gives
    them), the others the whole input; each a leaf with a gradient."""
    if isinstance(layer, RowParallelDense):
        cut = Split(X.ndim - 1, layer.shard_specs()["weight"].parts, layer.shard_specs()["weight"].unit)
        inputs = Ranks([cut.local(X, t, T).copyto(ctx) for t, ctx in enumerate(contexts(T))])
        for x in inputs.arrays:
            x.attach_grad()
        return inputs, lambda: cut.join([x.grad for x in inputs.arrays])
    X = X.copy()
    X.attach_grad()
    return X, lambda: X.grad


@pytest.mark.parametrize("T", [2, 3])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_ranks_mode_is_the_base_class_arithmetic(kind, T):
    """Forward, the parameters' and the input's gradients of each layer on T ranks (``run_ranks`` of the layer
    itself) against its gluon base class on one context, for the same output gradient on every rank."""
    layer, base, shape = LAYERS[kind]()
    X = _pair(layer, base, shape, seed=T)
    head = mx.nd.random.uniform(-1, 1, shape=base(X).shape)
    X_base = X.copy()
    X_base.attach_grad()
    with autograd.record():
        want = base(X_base)
    want.backward(head)
    inputs, input_grad = _rank_inputs(layer, X, T)
    parts, tape = replicate_ranks(layer, contexts(T)), SegmentTape()
    with autograd.record():
        out = run_ranks(layer, inputs, parts, tape)
    split = kind == "column"   # each rank's units: its part of the output and of its gradient
    cut = Split(X.ndim - 1, 3, 2)
    head_grads = [cut.local(head, t, T).copyto(ctx) if split else head.copyto(ctx) for t, ctx in enumerate(contexts(T))]
    tape.backward(out.arrays, head_grads)
    got = cut.join(out.arrays) if split else out[T - 1]
    assert _relative(got, want) <= RTOL
    for got, param in zip(joined_arrays(layer, [[a.grad for a in rank] for rank in parts]), _trainable(base)):
        assert _relative(got, param.grad()) <= RTOL, param.name
    assert _relative(input_grad(), X_base.grad) <= RTOL


# ---- the tape -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_ranks", [False, True], ids=["one array", "each rank's"])
def test_an_input_read_before_and_after_a_collective_gets_its_whole_gradient(as_ranks):
    """A pre-norm Transformer block reads its input in its first segment (the layer norm) and again after g (the
    residual): each rank's input (or the one input) gets the whole gradient, as on one context."""
    block = TransformerBlock(16, 4, 32)
    block.initialize(mx.init.Normal(0.1))
    X = mx.nd.random.uniform(shape=(3, 5, 16))
    head = mx.nd.random.uniform(-1, 1, shape=(3, 5, 16))
    X_one = X.copy()
    X_one.attach_grad()
    with autograd.record():
        want = block(X_one)
    want.backward(head)
    inputs = Ranks([X.copyto(ctx) for ctx in contexts(2)]) if as_ranks else X.copy()
    for x in inputs.arrays if as_ranks else [inputs]:
        x.attach_grad()
    parts, tape = replicate_ranks(block, contexts(2)), SegmentTape()
    with autograd.record():
        out = run_ranks(block, inputs, parts, tape)
    tape.backward(out.arrays, [head.copyto(ctx) for ctx in contexts(2)])
    assert _relative(out[1], want) <= RTOL
    for x in inputs.arrays if as_ranks else [inputs]:
        assert _relative(x.grad, X_one.grad) <= RTOL


def test_a_head_may_be_a_collectives_output_or_a_leaf():
    """g's outputs as heads (their gradient passed to each rank's partial sum), and a leaf the tape gave."""
    xs = [mx.nd.array([1.0, 2.0], ctx=ctx) for ctx in contexts(2)]
    for x in xs:
        x.attach_grad()
    tape = SegmentTape()
    with autograd.record():
        parts = [x * (t + 2) for t, x in enumerate(xs)]   # 2 x0, 3 x1
        tape.keep(parts, xs)
        summed = tape.g(parts)
    tape.backward(summed, [mx.nd.array([1.0, 10.0], ctx=ctx) for ctx in contexts(2)])
    assert xs[0].grad.asnumpy().tolist() == [2.0, 20.0] and xs[1].grad.asnumpy().tolist() == [3.0, 30.0]
    with autograd.record():
        parts = [x * 2 for x in xs]
        tape.keep(parts, xs)
        leaf = tape.read(tape.f(parts)[1])   # rank 1's output, read in a later segment: its leaf
    tape.backward([leaf], [mx.nd.ones((2,), ctx=mx.cpu(1))])
    assert xs[0].grad.asnumpy().tolist() == [2.0, 2.0]   # f's backward: the allreduce of the ranks' gradients
    assert tape.allreduced == 2 * 2 + 2 * 2


class _Twice(nn.HybridBlock):
    """A scale read on both sides of a collective: before a column-parallel layer's f and after its gather."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.scale = self.params.get("scale", shape=(4,), init=mx.init.One())
            self.dense = ColumnParallelDense(4, gather_output=True, in_units=4)

    def hybrid_forward(self, F, X, scale):
        return F.broadcast_mul(self.dense(F.broadcast_mul(X, scale)), scale)


def test_a_parameter_read_by_two_segments_is_refused():
    """Its gradient would be written by each segment's backward, the last one's kept: refused while recording,
    the block left as it was; evaluation (nothing recorded) computes it."""
    block = _Twice()
    block.initialize()
    X = mx.nd.random.uniform(shape=(2, 4))
    parts = replicate_ranks(block, contexts(2))
    with autograd.record():
        with pytest.raises(BadValue, match=f"parameter {block.scale.name} is read by two segments"):
            run_ranks(block, X, parts, SegmentTape())
    assert all("forward" not in vars(child) for child in [block, block.dense])
    assert _relative(run_ranks(block, X, parts)[0], block(X)) <= RTOL


def test_run_ranks_checks_its_arguments():
    block = ColumnParallelDense(4, in_units=3)
    block.initialize()
    parts = replicate_ranks(block, contexts(2))
    with pytest.raises(BadType, match="X must be an NDArray"):
        run_ranks(block, [mx.nd.ones((1, 3))], parts)
    with pytest.raises(BadType, match="must be a sequence of arrays with their param.names"):
        run_ranks(block, mx.nd.ones((1, 3)), [list(rank) for rank in parts])
    wrapper = nn.Sequential()
    wrapper.add(block)
    with pytest.raises(BadType, match="Sequential is not a HybridBlock"):
        run_ranks(wrapper, mx.nd.ones((1, 3)), parts)
    assert "forward" not in vars(block)
    with pytest.raises(BadValue, match="units=10 are not 3 part"):
        ColumnParallelDense(10, parts=3)
    with pytest.raises(BadValue, match="drop padding"):
        ParallelPatchEmbedding(4, 2, padding=1)


def test_ranks_compute_on_each_rank_and_are_not_a_tuple():
    x = Ranks([mx.nd.array([1.0, 2.0], ctx=ctx) for ctx in contexts(2)])
    assert not isinstance(x, (tuple, list)) and len(x) == 2 and repr(x) == "Ranks(2 ranks of (2,))"
    y = (1 - x) / 2 * x + x - 3
    assert [a.context for a in y.arrays] == contexts(2) and y[1].asnumpy().tolist() == [-2.0, -2.0]
    assert (-x)[0].asnumpy().tolist() == [-1.0, -2.0] and (2 / x)[0].asnumpy().tolist() == [2.0, 1.0]
    F = RanksF(2)
    first, second = F.split(x, num_outputs=2, axis=0)
    assert second[1].asnumpy().tolist() == [2.0]
    shifted = F.broadcast_add(x, F.per_rank([mx.nd.array([10.0], ctx=ctx) for ctx in contexts(2)]))
    assert shifted[1].asnumpy().tolist() == [11.0, 12.0]
    assert x.detach()[0].asnumpy().tolist() == [1.0, 2.0]
    with pytest.raises(BadValue, match="needs a tape"):
        F.g(x)


# ---- the specs ------------------------------------------------------------------------------------------------------

@pytest.mark.property
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.booleans(),
       st.integers(0, 1), st.integers(1, 4), st.integers(0, 2 ** 16))
def test_split_cuts_and_joins_any_array_exactly(parts, unit, blocks, T, flatten, axis, other, seed):
    """Split's local -> join round trip is the identity; the ranks' indices cover the axis once, in chunk_bounds'
    runs; local_shape is the local part's shape; Replicated's round trip too."""
    length = parts * unit * blocks
    shape = (length, other) if axis == 0 else (other, length)
    if flatten:   # the 2-D view's columns are the trailing axes' elements
        shape = (shape[0], 1, shape[1]) if axis == 1 else shape + (1,)
    spec = Split(axis, parts, unit, flatten)
    whole = np.random.RandomState(seed).rand(*shape).astype(np.float32)
    local = [spec.local(mx.nd.array(whole), t, T) for t in range(T)]
    assert [a.shape for a in local] == [spec.local_shape(shape, t, T) for t in range(T)]
    np.testing.assert_array_equal(spec.join(local, shape=shape).asnumpy(), whole)
    np.testing.assert_array_equal(spec.join([a.asnumpy() for a in local], shape=shape), whole)
    indices = np.concatenate([spec.indices(length, t, T) for t in range(T)])
    assert sorted(indices.tolist()) == list(range(length))
    sizes = [len(spec.indices(length, t, T)) for t in range(T)]
    assert max(sizes) - min(sizes) <= parts * unit and sizes == sorted(sizes, reverse=True)
    np.testing.assert_array_equal(Replicated().join([Replicated().local(whole, t, T).asnumpy() for t in range(T)]),
                                  whole)


def test_split_checks_its_arguments():
    with pytest.raises(BadValue, match="parts must be >= 1"):
        Split(0, parts=0)
    with pytest.raises(BadType, match="flatten must be True or False"):
        Split(0, flatten=1)
    with pytest.raises(BadValue, match="length=10 is not 3 part"):
        Split(0, parts=3).indices(10, 0, 2)
    with pytest.raises(BadValue, match="t must be between 0 and 1"):
        Split(0).indices(4, 2, 2)
    with pytest.raises(BadValue, match="axis=2 is not an axis"):
        Split(2).local_shape((3, 4), 0, 2)
