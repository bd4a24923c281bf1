"""Every layout is one composed step (issue 36): the fifteen layouts of the kinds Megatron-LM, DeepSpeed and
torchtitan run, which the package once refused eleven of, each train the one-context ViT; so do each axis alone and
the compositions the per-axis files once proved one axis at a time (this is the one place a layout is proved to
train the one-context model: a per-axis file proves only its own mechanism); what is still refused says why.

Fast tier: three steps with momentum in float64, each layout within 1e-12 of every array's scale of one context
(a real difference, a wrong gradient or a stale buffer, is many orders larger); the two layouts that name a job
with two workers in threads (the kvstore's servers stood in for). Slow tier: the issue's measure, one epoch of the
digits in float32 within 1e-5 of each array's scale, and the two job layouts under the launcher.

The row Transformer's token layouts (issue 46: context, sequence and experts, ``TRANSFORMER``) train its own
one-context model the same way; one cell fast, the others slow.
"""
import fcntl
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from parallel import Layout, Reducer, RunConfig, fit, init_model, shard_sizes, trace
from parallel import checkpoint as ckpt
from parallel.data import Dataset
from parallel.fit import TrainingStopped
from parallel.models.moe import Experts
from parallel.models.transformer import init_transformer
from parallel.models.vit import init_vit
from parallel.optim import SGD
from parallel.strategies import make_strategy
from parallel.strategies.hybrid import Hybrid
from parallel.train import main
from conftest import (assert_close_to_scale, assert_same_arrays, contexts, fast_only, in_threads, labels_hold,
                      load_benchmark, small_resnet, start_process, stop_before, stop_process, write_idx_files)

#: The fifteen layouts: the eleven once refused (the tenth compresses: it trains, not the same sums), the two of the
#: eleventh that name a job, and the four accepted before. Each: the layout and how many contexts it takes.
LAYOUTS = {
    "tensor x ZeRO-3": (Layout("data", tensor=2, zero=3), 4),
    "tensor x recomputation": (Layout("data", tensor=2, recompute=True), 4),
    "pipeline x tensor, 1F1B": (Layout("pipeline", stages=2, tensor=2, micro_batches=4, schedule="1f1b"), 4),
    "pipeline x recomputation": (Layout("pipeline", stages=2, micro_batches=4, recompute=True), 2),
    "data x pipeline x ZeRO-3": (Layout("hybrid", stages=2, zero=3), 4),
    "data x pipeline, micro-batches, 1F1B": (Layout("hybrid", stages=2, micro_batches=4, schedule="1f1b"), 4),
    "data x pipeline x tensor, 1F1B": (Layout("hybrid", stages=2, tensor=2, micro_batches=4, schedule="1f1b"), 8),
    "ZeRO-1 x recomputation": (Layout("data", zero=1, recompute=True), 2),
    "model x recomputation": (Layout("model", stages=2, recompute=True), 2),
    "tensor, compressed data-parallel sum": (Layout("data", tensor=2, compression="fp16"), 4),
    "interleaved 1F1B": (Layout("pipeline", stages=2, virtual=2, micro_batches=4, schedule="1f1b"), 2),
    "tensor x accumulation": (Layout("data", tensor=2, accumulate=2), 4),
    "ZeRO-3 x recomputation x accumulation": (Layout("data", zero=3, recompute=True, accumulate=2), 2),
    "data x pipeline x ZeRO-2": (Layout("hybrid", stages=2, zero=2), 4),
}
#: The layouts that name a job: each worker a layout of its own contexts, the job's workers its data replicas.
JOBS = {
    "hybrid without tensor, in a job": (Layout("hybrid", stages=2), 4),
    "pipeline with 1F1B, in a job": (Layout("pipeline", stages=2, micro_batches=4, schedule="1f1b"), 2),
}
#: Beyond the fifteen: ZeRO-3 with micro-batches over several replicas (the last batch leaves a replica's last
#: micro-batch empty, and another's), and every axis at once.
MORE = {
    "data x pipeline x ZeRO-3, micro-batches": (Layout("hybrid", stages=2, zero=3, micro_batches=4), 4),
    "every axis at once": (Layout("hybrid", stages=2, tensor=2, micro_batches=4, schedule="1f1b", zero=3,
                                  recompute=True, accumulate=2), 8),
    # issue 39: sequence parallelism with tensor ranks, alone and across pipeline stages, ZeRO-1, recomputation
    "sequence x tensor": (Layout("data", tensor=2, sequence=True), 2),
    "sequence x tensor x pipeline, 1F1B": (Layout("pipeline", stages=2, tensor=2, micro_batches=4, schedule="1f1b",
                                                  sequence=True), 4),
    "data x sequence x tensor, ZeRO-1, recomputation": (Layout("data", tensor=2, sequence=True, zero=1,
                                                               recompute=True), 4),
    "data x sequence x tensor x pipeline x ZeRO-3, micro-batches": (Layout("hybrid", stages=2, tensor=2,
                                                                           sequence=True, zero=3,
                                                                           micro_batches=4), 8),
}
#: Each axis alone and the compositions the per-axis files once proved against one context, one axis at a time
#: (the suite that proves each claim once): data parallelism on 2 and 3 contexts (the last batch split 2, 2, 1),
#: GPipe's pipeline, the model strategy's stages and 2 replicas of 2 stages; 1F1B alone; tensor ranks 2, 4 and 3
#: (3 split the 4 heads and the MLP's units unevenly), over 2 data replicas, over 2 stages (with and without 2
#: replicas of them) and over 3; sequence parallelism over 4 tensor ranks.
ALONE = {
    "data, 2 contexts": (Layout("data"), 2),
    "data, 3 contexts": (Layout("data"), 3),
    "pipeline, GPipe": (Layout("pipeline", stages=2, micro_batches=3), 2),
    "pipeline, 1F1B": (Layout("pipeline", stages=2, micro_batches=4, schedule="1f1b"), 2),
    "model": (Layout("model", stages=2), 2),
    "data x pipeline": (Layout("hybrid", stages=2), 4),
    "tensor": (Layout("data", tensor=2), 2),
    "tensor, 4 ranks": (Layout("data", tensor=4), 4),
    "tensor, 3 ranks splitting unevenly": (Layout("data", tensor=3), 3),
    "data x tensor": (Layout("data", tensor=2), 4),
    "pipeline x tensor": (Layout("hybrid", stages=2, tensor=2), 4),
    "data x pipeline x tensor": (Layout("hybrid", stages=2, tensor=2), 8),
    "3 stages x tensor": (Layout("hybrid", stages=3, tensor=2), 6),
    "sequence x tensor, 4 ranks": (Layout("data", tensor=4, sequence=True), 4),
}
EXACT = sorted(name for name, (layout, _) in {**LAYOUTS, **MORE, **ALONE}.items() if layout.compression == "none")

SIZES = (12, 12, 5)   # the last batch leaves replicas idle and micro-batches empty


def _batches(dtype, sizes=SIZES):
    rng = np.random.RandomState(3)
    return [(mx.nd.array(rng.uniform(size=(n, 1, 28, 28)), dtype=dtype), mx.nd.array(rng.randint(0, 10, n)))
            for n in sizes]


def _train(strategy, layout, batches):
    optimizer = SGD(0.05, momentum=0.9, zero=layout.zero)
    for X, y in batches:
        strategy.train_step(X, y, optimizer=optimizer, accumulate=min(layout.accumulate, X.shape[0]))
    return [p.asnumpy() for p in strategy.params()]


def _regrouped(batches, replicas, m):
    """Each batch reordered so that one context's ``accumulate=m`` parts are the micro-batches ``replicas`` replicas
    run together (part ``i`` of every replica's shard, in the replicas' order): what a mixture of experts routes as
    one queue, with its own capacity and balance. The same batches when ``m`` or ``replicas`` is 1."""
    regrouped = []
    for X, y in batches:
        n = X.shape[0]
        shards = np.split(np.arange(n), np.cumsum(shard_sizes(n, replicas))[:-1])
        parts = [[] for _ in range(m)]
        for shard in shards:
            for i, piece in enumerate(np.split(shard, np.cumsum(shard_sizes(len(shard), min(m, len(shard))))[:-1])):
                parts[i].append(piece)
        assert [sum(map(len, part)) for part in parts if part] == shard_sizes(n, min(m, n))   # one context's parts
        order = mx.nd.array(np.concatenate([piece for part in parts for piece in part]), dtype="int64")
        regrouped.append((mx.nd.take(X, order), mx.nd.take(y, order)))
    return regrouped


@pytest.fixture(scope="module")
def one_context():
    """The ViT in float64 trained on one context, momentum SGD."""
    return _train(make_strategy("data", init_vit(0, dtype="float64"), contexts(1)), Layout(), _batches("float64"))


def _moe():
    return init_vit(0, dtype="float64", experts=Experts(4, top_k=2))


def _vit_of_50_tokens():
    return init_vit(0, dtype="float64", patch=4)


@pytest.fixture(scope="module")
def one_context_fed():
    """``one_context_fed(model, parts, sizes, replicas)``: the model ``model()`` trained on one context, each batch
    fed in ``parts`` accumulated parts (each routed alone, as each micro-batch of a layout is; the examples of
    ``replicas`` replicas' micro-batches, ``_regrouped``): its arrays and its epoch
    metrics. Trained once for every cell that compares with it (a model is deterministic: the cells compared with
    a fresh copy of the same run before)."""
    runs = {}

    def run(model, parts, sizes=SIZES, replicas=1):
        key = model, parts, sizes, replicas
        if key not in runs:
            one = Layout(accumulate=parts)
            strategy = make_strategy(one, model(), contexts(1))
            runs[key] = (_train(strategy, one, _regrouped(_batches("float64", sizes), replicas, parts)),
                         strategy.epoch_metrics())
        return runs[key]
    return run


#: The cells of the matrix's first column the fast tier runs: every axis, strategy and schedule at least once
#: (sequence parallelism across stages in 1F1B; interleaved 1F1B; the model strategy; uneven shards of data and of
#: tensor ranks; GPipe; ZeRO-1, ZeRO-2 across stages, ZeRO-3 with recomputation and accumulation); the slow tier runs
#: every layout of EXACT, every axis at once among them.
_FAST_CELLS = ("sequence x tensor x pipeline, 1F1B", "interleaved 1F1B", "model x recomputation", "data, 3 contexts",
               "tensor, 3 ranks splitting unevenly", "pipeline, GPipe", "data x pipeline x ZeRO-2",
               "ZeRO-1 x recomputation", "ZeRO-3 x recomputation x accumulation")


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in _FAST_CELLS else pytest.mark.slow)
                                  for name in EXACT])
def test_every_layout_trains_the_one_context_vit(name, one_context):
    layout, k = {**LAYOUTS, **MORE, **ALONE}[name]
    strategy = make_strategy(layout, init_vit(0, dtype="float64"), contexts(k))
    got = _train(strategy, layout, _batches("float64"))
    assert_close_to_scale(got, one_context, 1e-12)
    initial = [p.data().asnumpy() for p in init_vit(0, dtype="float64").collect_params().values()]
    assert max(np.abs(a - b).max() for a, b in zip(got, initial)) > 1e-3   # it trained


# ---- the matrix's other columns: each layout resumes, and each label of its timeline holds ---------------------

#: The cell of the resume column the fast tier runs (ZeRO-3's shards, gathered into the checkpoint, with recomputation
#: and accumulation); the slow tier runs every layout of EXACT.
_FAST_COLUMNS = ("ZeRO-3 x recomputation x accumulation",)


def _column(names):
    return [pytest.param(name, marks=() if name in _FAST_COLUMNS else pytest.mark.slow) for name in names]


def _digit_images(seed, n):
    rng = np.random.RandomState(seed)
    return rng.randint(0, 255, (n, 28, 28)).astype(np.uint8), rng.randint(0, 10, n).astype(np.uint8)


#: 29 training images: batches of 12, 12 and 5 an epoch (the last leaves replicas idle and micro-batches empty).
_IMAGES = Dataset(*_digit_images(5, 29), *_digit_images(6, 8))
_FIT_RUNS = {}


def _fit(layout, k, checkpoint=None, stop=None, on_checkpoint=None):
    """The ViT trained by ``fit`` for two epochs of ``_IMAGES`` (momentum SGD) on ``layout`` over ``k`` contexts,
    from ``checkpoint`` if given, stopped by ``stop``: its arrays. A run from the start and to the end is kept for
    the module."""
    key = (layout, k)
    if checkpoint is None and stop is None and key in _FIT_RUNS:
        return _FIT_RUNS[key]
    model = init_model("vit", 0, *(() if checkpoint is None else (checkpoint.params, checkpoint.aux)))
    strategy = make_strategy(layout, model, contexts(k))
    config = RunConfig(epochs=2, batch_size=12, seed=1, accumulate=layout.accumulate)
    try:
        fit(_IMAGES, strategy, SGD(0.05, momentum=0.9, zero=layout.zero), config, stop=stop,
            on_checkpoint=on_checkpoint, resume=checkpoint)
    except TrainingStopped:
        return None
    got = [p.asnumpy() for p in strategy.params()]
    if checkpoint is None and stop is None:
        _FIT_RUNS[key] = got
    return got


@pytest.mark.parametrize("name", _column(EXACT))
def test_every_layout_resumes_bitwise_and_on_one_context_within_rounding(name, tmp_path):
    """Stopped mid-epoch (before its second step), checkpointed to disk and resumed: on the same layout, bitwise
    the run never stopped; on one context, the one-context run to float32 rounding (1e-5 of each array's scale)."""
    layout, k = {**LAYOUTS, **MORE, **ALONE}[name]
    assert _fit(layout, k, stop=stop_before(2), on_checkpoint=ckpt.CheckpointWriter(tmp_path, {}, "vit")) is None
    saved = ckpt.load_checkpoint(tmp_path)
    assert (saved.state.epoch, saved.state.batch) == (1, 1)
    assert_same_arrays([_fit(layout, k, checkpoint=saved)], [_fit(layout, k)])
    one = _fit(Layout(), 1)
    assert_close_to_scale(_fit(Layout(), 1, checkpoint=saved), one, 1e-5)
    initial = [p.data().asnumpy() for p in init_model("vit", 0).collect_params().values()]
    assert max(np.abs(a - b).max() for a, b in zip(one, initial)) > 1e-3   # it trained: equal is not trivially so


#: The trace column's cells in the fast tier (ZeRO-3's gathers, interleaved chunks, sequence parallelism's
#: collectives), each on two contexts: MXNet's profiler records no more CPU contexts than the machine has processors.
_FAST_TRACES = ("ZeRO-3 x recomputation x accumulation", "interleaved 1F1B", "sequence x tensor")


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in _FAST_TRACES else pytest.mark.slow)
                                  for name in EXACT])
def test_every_layout_s_timeline_labels_hold(name):
    """A traced step of the layout (``parallel.trace``): a lane per context it uses, and every operator named
    after an issuer ran inside a bracket that issuer queued on its lane (``labels_hold``). A layout on more
    contexts than the machine has processors cannot be traced (MXNet's profiler records cpu(0)..cpu(N-1))."""
    layout, k = {**LAYOUTS, **MORE, **ALONE}[name]
    processors = len(os.sched_getaffinity(0))
    if k > processors:
        pytest.skip(f"{k} contexts: MXNet's profiler records only {processors} CPU contexts here")
    strategy = make_strategy(layout, init_vit(0), contexts(k))
    optimizer = SGD(0.05, momentum=0.9, zero=layout.zero)
    X, y = _batches("float32")[0]
    strategy.train_step(X, y, optimizer=optimizer, accumulate=layout.accumulate)
    with trace(contexts=strategy.ctx_list) as recorded:
        strategy.train_step(X, y, optimizer=optimizer, accumulate=layout.accumulate)
    assert recorded.result.lanes == [str(ctx) for ctx in strategy.ctx_list]
    labels_hold(recorded.result)


@pytest.mark.parametrize("layout, k", fast_only([(Layout(expert_parallel=2), 4),
                                                   (Layout(expert_parallel=4, zero=1), 4), (Layout(accumulate=2), 2)],
                                                  fast={1}))
def test_experts_x_data_trains_the_one_context_moe_vit(layout, k, one_context_fed):
    """A mixture of experts (issue 39): its experts spread over groups of data replicas (with ZeRO-1, with
    accumulation), the one-context MoE ViT in float64 (the last batch of 5 on 4 contexts too: a member no token
    reaches). Micro-batches are routed one at a time (each its own capacity and balance), as on one context."""
    want, _ = one_context_fed(_moe, layout.accumulate)
    got = _train(make_strategy(layout, _moe(), contexts(k)), layout, _batches("float64"))
    assert_close_to_scale(got, want, 1e-12)


@pytest.mark.parametrize("layout, k, parts", fast_only([
    (Layout("pipeline", stages=2, micro_batches=2, schedule="1f1b"), 2, 2),
    (Layout("hybrid", stages=2, expert_parallel=2, zero=2, recompute=True), 4, 1),
    (Layout("hybrid", stages=2, expert_parallel=2, zero=3), 4, 1),
    (Layout("data", tensor=2, expert_parallel=2), 4, 1),
    (Layout("pipeline", stages=2, tensor=2, micro_batches=2, schedule="1f1b"), 4, 2),
    (Layout("data", tensor=2, expert_parallel=2, zero=3), 8, 1),
    (Layout("hybrid", stages=2, tensor=2, zero=3, micro_batches=2), 8, 2),
    (Layout(context=2, expert_parallel=2), 4, 1),
    (Layout("hybrid", stages=2, context=2, expert_parallel=2, zero=3), 8, 1),
    # issue 46: sequence parallelism, each tensor rank routing its slice of the sequence
    (Layout(tensor=2, sequence=True), 2, 1),
    (Layout(tensor=2, sequence=True, expert_parallel=2), 4, 1),
    (Layout("pipeline", stages=2, tensor=2, sequence=True, micro_batches=2, schedule="1f1b"), 4, 2),
    (Layout(tensor=2, sequence=True, expert_parallel=2, zero=3), 8, 1),
], fast={0, 10}))
def test_experts_x_pipeline_x_tensor_train_the_one_context_moe_vit(layout, k, parts, one_context_fed):
    """A mixture of experts across pipeline stages (each stage's replicas in lockstep, ``parallel.models.lockstep``;
    the auxiliary losses backward heads of the chunk that made them): 2 stages fed 2 micro-batches in 1F1B's order,
    the one-context model fed the same 2 parts of each batch (``accumulate``: each part routed alone, as each
    micro-batch is; with replicas, each part the examples of the replicas' micro-batch, ``_regrouped``); 2 replicas
    x 2 stages with expert parallelism, ZeRO-2 and recomputation (the last batch of 5:
    3 and 2 examples), and with ZeRO-3 (each member's experts sharded over the replicas holding them); over tensor
    ranks (each replica a tensor group: the experts whole on each rank, each rank's copy of the tokens routed the
    same), with expert parallelism and across 2 stages, and with ZeRO-3 (each rank's dense parts and its copy of
    its member's experts sharded over the replicas, issue 46); with each example's tokens split over context groups
    (each member routing its slice, queued in one context's order: ``moe._one_queue``), with expert parallelism,
    across stages with ZeRO-3; with sequence parallelism (each tensor rank routing its slice of the sequence, all
    the ranks' slices one queue in one context's order, the router's and experts' gradients summed over the ranks),
    with expert parallelism, across stages, with ZeRO-3: the one-context model, the same tokens kept and dropped.
    A chunk's routing is counted once, recomputed or not, over tensor ranks or not."""
    strategy = make_strategy(layout, _moe(), contexts(k))
    assert isinstance(strategy, Hybrid) and strategy.lockstep
    want, metrics = one_context_fed(_moe, parts, replicas=len(strategy.in_ctx_list) if parts > 1 else 1)
    got = _train(strategy, layout, _batches("float64"))
    assert_close_to_scale(got, want, 1e-12)
    mine, theirs = strategy.epoch_metrics()["experts"], metrics["experts"]
    assert mine["tokens"] == theirs["tokens"] and mine["dropped"] == theirs["dropped"]
    assert abs(mine["aux_loss"] - theirs["aux_loss"]) < 1e-9 * theirs["aux_loss"]


@pytest.mark.parametrize("layout, k, parts", fast_only([
    (Layout("pipeline", stages=2, context=2, micro_batches=2), 4, 2),
    (Layout("hybrid", stages=2, context=2, recompute=True), 8, 1),
    (Layout("data", context=2, zero=3), 4, 1),
    (Layout("data", context=2, tensor=2), 4, 1),
    (Layout("hybrid", context=2, tensor=2, stages=2, zero=3), 8, 1),
    # issue 46: sequence parallelism inside each member's tensor group
    (Layout("data", context=2, tensor=2, sequence=True), 4, 1),
    (Layout("data", context=2, tensor=2, sequence=True, zero=1), 8, 1),
    (Layout("pipeline", stages=2, context=2, tensor=2, micro_batches=2, schedule="1f1b", sequence=True), 8, 2),
    (Layout("hybrid", context=2, tensor=2, stages=2, sequence=True, zero=3), 8, 1),
], fast={5}))
def test_context_x_pipeline_x_tensor_and_zero_3_train_the_one_context_vit_of_50_tokens(layout, k, parts,
                                                                                       one_context_fed):
    """Each example's tokens split over a group through pipeline stages (a group's members replicas of their own, in
    lockstep through every chunk), with recomputation, with ZeRO-3 (each block gathered on every member: the
    members but the first leave their head's gradient unwritten, so its buffer is zeroed first), and over tensor
    ranks (each member a tensor group: each rank's heads round the ring of its rank in every member). With sequence
    parallelism too (issue 46): each member's 25 tokens split 13 and 12 over its tensor group between the parallel
    layers, gathered for attention round the ring; on 2 replicas of a group, with ZeRO-1, across 2 stages fed 2
    micro-batches in 1F1B's order, and with ZeRO-3 (a token split wrong, or a slice summed twice, is a real
    difference)."""
    want, _ = one_context_fed(_vit_of_50_tokens, parts, (12, 12, 4))
    strategy = make_strategy(layout, _vit_of_50_tokens(), contexts(k))
    shape = strategy.mesh.shape
    assert isinstance(strategy, Hybrid) and len(strategy.in_ctx_list) == k // 2 // shape.stage // shape.tensor
    got = _train(strategy, layout, _batches("float64", (12, 12, 4)))
    assert_close_to_scale(got, want, 1e-12)


@pytest.mark.parametrize("layout, k", fast_only([(Layout(context=2), 2), (Layout(context=4), 4),
                                                   (Layout(context=2), 4), (Layout(context=2, zero=2), 4),
                                                   (Layout(context=4, accumulate=2), 4)], fast={0, 3}))
def test_context_x_data_trains_the_one_context_vit_of_50_tokens(layout, k, one_context_fed):
    """Each example's 50 tokens split over groups of contexts (issue 39: ring attention): one group of 2 and of 4,
    data parallelism over the groups, with ZeRO-2 and accumulation: the one-context ViT of 4x4 patches in float64."""
    want, _ = one_context_fed(_vit_of_50_tokens, 1, (12, 12, 4))
    strategy = make_strategy(layout, _vit_of_50_tokens(), contexts(k))
    assert isinstance(strategy, Hybrid) and len(strategy.in_ctx_list) == k // layout.context
    got = _train(strategy, layout, _batches("float64", (12, 12, 4)))
    assert_close_to_scale(got, want, 1e-12)


def _transformer():
    return init_transformer(0, dtype="float64")


def _moe_transformer():
    return init_transformer(0, dtype="float64", experts=Experts(4, top_k=2))


#: Issue 46: the row Transformer (``parallel.models.transformer``) through the seams the ViT calls, its 28 rows the
#: tokens: context parallelism (14 rows a member, ring attention, the members' rows gathered for the mean), sequence
#: parallelism (a pipeline stage and a recomputed block that start inside the region: the model's plan), both, and
#: its experts variant (a mixture of 4 experts, top-2, in its second block) with expert parallelism, sequence and
#: context parallelism. Each: the model, the layout, its contexts, the parts of a batch the one-context model is fed.
TRANSFORMER = {
    "context": (_transformer, Layout(context=2), 2, 1),
    "context x data, ZeRO-2": (_transformer, Layout(context=2, zero=2), 4, 1),
    "context x pipeline, micro-batches": (_transformer, Layout("pipeline", stages=2, context=2, micro_batches=2), 4, 2),
    "sequence x tensor": (_transformer, Layout(tensor=2, sequence=True), 2, 1),
    "sequence x tensor, recomputation": (_transformer, Layout(tensor=2, sequence=True, recompute=True), 2, 1),
    "sequence x tensor x pipeline, 1F1B": (_transformer, Layout("pipeline", stages=2, tensor=2, sequence=True,
                                                                micro_batches=2, schedule="1f1b"), 4, 2),
    "context x sequence x tensor, ZeRO-3": (_transformer, Layout(context=2, tensor=2, sequence=True, zero=3), 4, 1),
    "experts": (_moe_transformer, Layout(accumulate=2), 2, 2),
    "experts x expert parallelism": (_moe_transformer, Layout(expert_parallel=2), 4, 1),
    "experts x sequence x tensor, expert parallelism": (_moe_transformer, Layout(tensor=2, sequence=True,
                                                                                 expert_parallel=2), 4, 1),
    "experts x context": (_moe_transformer, Layout(context=2, expert_parallel=2), 4, 1),
}
#: The Transformer's cell in the fast tier: blocks recomputed one by one, each starting inside the sequence region.
_FAST_TRANSFORMER = ("sequence x tensor, recomputation",)


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in _FAST_TRANSFORMER else pytest.mark.slow)
                                  for name in sorted(TRANSFORMER)])
def test_the_transformer_s_token_layouts_train_its_one_context_model(name, one_context_fed):
    """The Transformer of issue 46 (its file names no axis) on each layout of ``TRANSFORMER``: the one-context
    model in float64 (with experts, each part of a batch routed alone, as each micro-batch is; the same tokens
    kept and dropped)."""
    model, layout, k, parts = TRANSFORMER[name]
    sizes = (12, 12, 4)
    strategy = make_strategy(layout, model(), contexts(k))
    # a pipeline's micro-batches are parts of each replica's shard; accumulation's parts of the whole batch
    want, metrics = one_context_fed(model, parts, sizes, len(strategy.in_ctx_list) if layout.micro > 1 else 1)
    got = _train(strategy, layout, _batches("float64", sizes))
    assert_close_to_scale(got, want, 1e-12)
    initial = [p.data().asnumpy() for p in model().collect_params().values()]
    assert max(np.abs(a - b).max() for a, b in zip(got, initial)) > 1e-3   # it trained
    if strategy.lockstep and model is _moe_transformer:
        mine, theirs = strategy.epoch_metrics()["experts"], metrics["experts"]
        assert mine["tokens"] == theirs["tokens"] and mine["dropped"] == theirs["dropped"]


def test_the_compressed_tensor_layout_trains_close_to_one_context():
    """fp16 between the replicas of each rank, with error feedback: the same model to fp16's rounding, not the
    same sums; the codec kept a residual for every rank's group."""
    layout, k = LAYOUTS["tensor, compressed data-parallel sum"]
    reducer = Reducer(compression=layout.compression)
    strategy = make_strategy(layout, init_vit(0), contexts(k), reducer=reducer)
    got = _train(strategy, layout, _batches("float32"))
    want = _train(make_strategy("data", init_vit(0), contexts(1)), Layout(), _batches("float32"))
    assert_close_to_scale(got, want, 1e-2)
    assert len(reducer.codec.residuals) >= 2 * 2   # each rank's group, on its 2 replicas' contexts
    with pytest.raises(AssertionError):
        assert_close_to_scale(got, want, 1e-7)   # fp16's rounding is there


@pytest.mark.parametrize("name", sorted(JOBS))
def test_the_job_layouts_train_the_one_context_vit_in_threads(name, one_context, threads_reduce_at_once):
    """Two workers (threads standing in for ps-lite's servers), each the layout on contexts of its own; rank 1
    starts from another model (rank 0's wins); every worker ends with the one-context model."""
    layout, k = JOBS[name]

    def work(job, rank):
        initial = init_vit(0 if rank == 0 else 5, dtype="float64")
        strategy = make_strategy(layout, initial, [mx.cpu(k * rank + i) for i in range(k)], reducer=Reducer(job=job))
        return _train(strategy, layout, _batches("float64"))
    first, second = in_threads(2, work)[0]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert_close_to_scale(first, one_context, 1e-12)


#: The cross barrier (``Reducer(cross_barrier=True)``: each bucket's parameters a buffer of their own, updated first
#: layers first; in a job the first layers' sums sent first once backward ends): pipeline stages over data replicas
#: in one process, and data replicas in a job of two workers (threads). Each: the layout, contexts a worker, workers.
CROSS = {"data x pipeline, cross barrier": (Layout("hybrid", stages=2), 4, 1),
         "data, cross barrier, in a job": (Layout("data"), 2, 2)}


@pytest.mark.parametrize("name", sorted(CROSS))
def test_a_cross_barrier_trains_bitwise_the_layout_s_model_without_it(name, one_context, threads_reduce_at_once):
    """The same sums and updates in another order: bitwise the run without a cross barrier, and the one-context
    model within 1e-12; every replica's parameters split, in enough buckets that a job holds some back."""
    from parallel.comm.reducer import CROSS_HOLD
    layout, k, workers = CROSS[name]

    def run(cross):
        def work(job, rank):
            reducer = Reducer(bucket_mb=0.02, job=job, cross_barrier=cross)
            strategy = make_strategy(layout, init_vit(0 if rank == 0 else 5, dtype="float64"),
                                     [mx.cpu(k * rank + i) for i in range(k)], reducer=reducer)
            replicas = [replica for group in strategy.groups() for replica in group]
            assert all((replica.pieces is not None) == cross and len(replica.buckets) > CROSS_HOLD + 1
                       for replica in replicas)
            return _train(strategy, layout, _batches("float64"))
        return work(None, 0) if workers == 1 else in_threads(workers, work)[0][0]
    got = run(True)
    assert_same_arrays([got], [run(False)])
    assert_close_to_scale(got, one_context, 1e-12)


def test_a_cross_barrier_resumes_bitwise(tmp_path):
    """The resume column's cell for a cross barrier: stopped before its second step and checkpointed, resumed into
    a new strategy (which splits the checkpoint's parameters again), bitwise the run never stopped."""
    layout, k, _ = CROSS["data x pipeline, cross barrier"]

    def run(checkpoint=None, stop=None, on_checkpoint=None):
        model = init_model("vit", 0, *(() if checkpoint is None else (checkpoint.params, checkpoint.aux)))
        strategy = make_strategy(layout, model, contexts(k), reducer=Reducer(bucket_mb=0.02, cross_barrier=True))
        try:
            fit(_IMAGES, strategy, SGD(0.05, momentum=0.9), RunConfig(epochs=2, batch_size=12, seed=1), stop=stop,
                on_checkpoint=on_checkpoint, resume=checkpoint)
        except TrainingStopped:
            return None
        return [p.asnumpy() for p in strategy.params()]
    assert run(stop=stop_before(2), on_checkpoint=ckpt.CheckpointWriter(tmp_path, {}, "vit")) is None
    saved = ckpt.load_checkpoint(tmp_path)
    assert (saved.state.epoch, saved.state.batch) == (1, 1)
    assert_same_arrays([run(checkpoint=saved)], [run()])


@pytest.mark.parametrize("layout, model, error, says", [
    (Layout(tensor=2), "lenet", ValueError, "LeNet has none"),
    (Layout(tensor=8), "vit", ValueError, "cannot split ViT's 4 attention heads"),
    (Layout(zero=3, compression="fp16"), "vit", ValueError, "a residual of the whole gradient on every context"),
    (Layout("pipeline", virtual=2), "vit", ValueError, "interleaves 1F1B"),
    (Layout("pipeline", virtual=2, schedule="1f1b", micro_batches=3), "vit", ValueError, "a multiple of 2"),
    # issue 39: what the lockstep replicas of experts and context parallelism do not run in
    (Layout(context=2), "lenet", ValueError, "runs round a ring; LeNet has none"),
    (Layout(sequence=True), "vit", ValueError, "give tensor 2 or more"),
    (Layout(tensor=2, sequence=True), "resnet18", ValueError, "ResNet-18's do not"),
])
def test_what_the_mathematics_cannot_run_is_refused_with_its_reason(layout, model, error, says):
    with pytest.raises(error, match=says):
        layout.check(model)


def _digits(tmp_path):
    return write_idx_files(tmp_path, load_benchmark("digits_dataset").digits_dataset(num_train=1500))


def _epoch(tmp_path, data_dir, name, *extra, launch=False):
    """One epoch of the digits by the CLI, the ViT (``extra`` may name a variant), momentum SGD, batch 64, float32;
    the checkpointed arrays."""
    from parallel.checkpoint import load_checkpoint
    args = ["--model", "vit", "--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "64", "--lr", "0.05",
            "--momentum", "0.9", "--no-progress", "--checkpoint-dir", str(tmp_path / name), *extra]
    if launch:
        process = start_process([sys.executable, "-m", "parallel.launch", "-n", "2", "-s", "2", "--stall-timeout",
                                 "200", sys.executable, "-m", "parallel.train", *args], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            stop_process(process, grace=60)
            raise
        assert process.returncode == 0, err[-3000:]
    else:
        assert main(args) == 0
    return [p.asnumpy() for p in load_checkpoint(str(tmp_path / name)).params]


def _flags(layout, k):
    """The CLI's flags of ``layout`` on ``k`` contexts."""
    flags = ["--devices", f"cpu:{k}", "--strategy", layout.strategy, "--tensor", str(layout.tensor),
             "--zero", str(layout.zero), "--schedule", layout.schedule, "--virtual-stages", str(layout.virtual),
             "--accumulate", str(layout.accumulate), "--compression", layout.compression]
    flags += ["--stages", str(layout.stages)] if layout.stages is not None else []
    flags += ["--micro-batches", str(layout.micro_batches)] if layout.micro_batches is not None else []
    flags += ["--context", str(layout.context)] if layout.context > 1 else []
    flags += ["--expert-parallel", str(layout.expert_parallel)] if layout.expert_parallel > 1 else []
    flags += ["--sequence-parallel"] if layout.sequence else []
    return flags + (["--recompute"] if layout.recompute else [])


#: The models of the one-epoch column, as the CLI's flags: the ViT, the ViT of 50 tokens (4x4 patches: a sequence
#: that context groups split), and the mixture-of-experts ViT (4 experts, top-2, a capacity that drops no token,
#: so that every layout routes every token as one context does), of 17 or of 50 tokens.
_VIT, _VIT50 = (), ("--patch-size", "4")
_MOE = ("--experts", "4", "--top-k", "2", "--capacity-factor", "2.0")

#: The one-epoch column: (model, layout, contexts, under the launcher). The fifteen layouts and the two of a job
#: on the ViT; context parallelism and expert parallelism alone (once test_context.py's and test_experts.py's own
#: epochs); and the seven pairs issue 46 built, once refused.
ONE_EPOCH = {
    **{name: (_VIT, layout, k, False) for name, (layout, k) in LAYOUTS.items()},
    **{name: (_VIT, layout, k, True) for name, (layout, k) in JOBS.items()},
    "context, 2 contexts": (_VIT50, Layout(context=2), 2, False),
    "context, 4 contexts": (_VIT50, Layout(context=4), 4, False),
    "experts over 2 contexts": (_MOE, Layout(expert_parallel=2), 2, False),
    "experts over 4 contexts": (_MOE, Layout(expert_parallel=4), 4, False),
    "sequence x context": (_VIT50, Layout(context=2, tensor=2, sequence=True), 4, False),
    "context x experts": (_VIT50 + _MOE, Layout(context=2), 2, False),
    "context x experts across stages": (_VIT50 + _MOE, Layout("hybrid", stages=2, context=2), 4, False),
    "context x expert parallelism": (_VIT50 + _MOE, Layout(context=2, expert_parallel=2), 4, False),
    "sequence x experts": (_MOE, Layout(tensor=2, sequence=True), 2, False),
    "sequence x experts x expert parallelism": (_MOE, Layout(tensor=2, sequence=True, expert_parallel=2), 4, False),
    "ZeRO-3 x experts over tensor ranks": (_MOE, Layout(tensor=2, zero=3), 4, False),
}


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """``one_epoch(name, model, *flags, launch=False)``: the arrays one epoch of the digits leaves (``_epoch``),
    the digits written once; ``one_epoch.one_context(model)``, each model's one-context epoch, trained once in
    the whole run: the first xdist worker to need it trains it, under a lock, and leaves it for the others."""
    root = tmp_path_factory.mktemp("one_epoch")
    data_dir = _digits(root)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # this run's, every worker's

    def run(name, model, *flags, launch=False):
        return _epoch(root, data_dir, name, *model, *flags, launch=launch)

    def one_context(model):
        path = shared / f"one_epoch_reference_{'_'.join(m.strip('-') for m in model) or 'vit'}.npz"
        with open(f"{path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                arrays = run(f"one_{path.stem}", model, "--devices", "cpu:1")
                np.savez(f"{path}.tmp.npz", *arrays)
                os.replace(f"{path}.tmp.npz", path)   # whole or absent
            with np.load(path) as kept:
                return [kept[f"arr_{i}"] for i in range(len(kept.files))]
    run.one_context = one_context
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ONE_EPOCH))
def test_every_layout_trains_one_epoch_of_digits_as_one_context(name, one_epoch):
    """The issue's measure: one epoch of the digits with momentum SGD, every layout within 1e-5 of each array's
    scale of one context (float32, the same threads), the compressed one to fp16's rounding; the two job layouts
    under the launcher, two workers, real ps-lite servers."""
    model, layout, k, launch = ONE_EPOCH[name]
    want = one_epoch.one_context(model)
    got = one_epoch(name.replace(" ", "_").replace(",", ""), model, *_flags(layout, k), launch=launch)
    gap = max(np.abs(g - w).max() / np.abs(w).max() for g, w in zip(got, want))
    print(f"{gap:.2e}  {name}")   # with -s
    if layout.compression == "none":
        assert gap < 1e-5, gap
    else:
        assert 1e-7 < gap < 1e-2, gap


@pytest.mark.parametrize("stages, virtual, advice", [(2, 3, {"virtual": 2}), (3, 2, {"virtual": 1})])
def test_too_many_interleaved_chunks_are_refused_naming_the_flags_given_and_the_advice_works(stages, virtual,
                                                                                            advice):
    """``--virtual-stages 3`` on LeNet's 4 layers cut 2 x 3 = 6 chunks: the refusal names the stages and the
    virtual stages (not a ``--stages 6`` nobody typed), and the layout it advises builds."""
    from parallel import init_lenet_params
    ctx = [mx.cpu(i) for i in range(stages)]
    layout = Layout("pipeline", stages=stages, virtual=virtual, micro_batches=stages * 2, schedule="1f1b")
    with pytest.raises(ValueError, match=f"^{stages} stages x virtual_stages={virtual} make {stages * virtual} "
                                         f"chunks, which cannot split LeNet's 4 layers; use virtual_stages "
                                         f"{advice['virtual']}"):
        make_strategy(layout, init_lenet_params(seed=0), ctx)
    followed = layout.replace(**advice, schedule="1f1b" if advice["virtual"] > 1 else "gpipe")
    assert make_strategy(followed, init_lenet_params(seed=0), ctx).layout.chunks <= 4


# ---- BatchNorm across the workers of a job (issue 50) ---------------------------------------------------------------
#: Layouts whose replicas span a job's workers, with a BatchNorm network (a small ResNet: a stem and two residual
#: blocks): each worker the layout on contexts of its own, and the one-process layout it must equal (its replicas the
#: workers' together). GPipe's micro-batches normalise each on its own, so a pipeline's job equals the process whose
#: data replicas are the workers and whose micro-batches are theirs; accumulation's micro-batches are every worker's
#: i-th part together (one context fed them so: ``_regrouped``). (layout, contexts a worker, workers, the reference
#: layout and its contexts)
BATCHNORM_JOBS = {
    "data, 2 workers x 1 context": (Layout("data"), 1, 2, Layout("data"), 1),
    "data, 3 workers x 2 contexts": (Layout("data"), 2, 3, Layout("data"), 1),
    "data x recomputation, 2 workers x 2 contexts": (Layout("data", recompute=True), 2, 2, Layout("data"), 1),
    "ZeRO-2, 3 workers": (Layout("data", zero=2), 1, 3, Layout("data"), 1),
    "ZeRO-3 x recomputation, 2 workers x 2 contexts": (Layout("data", zero=3, recompute=True), 2, 2, Layout("data"), 1),
    "model, 2 workers x 2 stages": (Layout("model", stages=2), 2, 2, Layout("data"), 1),
    "data x recomputation x accumulation, 2 workers": (Layout("data", recompute=True, accumulate=2), 1, 2,
                                                       Layout("data", accumulate=2), 1),
    "pipeline x 1F1B x recomputation, 2 workers": (
        Layout("pipeline", stages=2, micro_batches=2, schedule="1f1b", recompute=True), 2, 2,
        Layout("hybrid", stages=2, micro_batches=2), 4),
}
#: Batches that leave a worker without an example (1 over 2 or 3 workers) and shards unequal.
BATCHNORM_SIZES = (12, 1, 7, 5)


def _resnet_state(strategy, layout, batches):
    """The small ResNet's trained arrays and running statistics after ``batches`` (momentum SGD)."""
    params = _train(strategy, layout, batches)
    return params, [a.asnumpy() for a in strategy.aux()]


def _batchnorm_job(name, statistics="job"):
    """Every worker's (arrays, running statistics, the pushes of BatchNorm's keys) after the job ``name`` of
    ``BATCHNORM_JOBS`` trains the small ResNet in float64, in threads."""
    layout, k, workers, _, _ = BATCHNORM_JOBS[name]

    def work(job, rank):
        job.statistics = statistics
        net = small_resnet()
        net.cast("float64")
        strategy = make_strategy(layout, net, [mx.cpu(k * rank + i) for i in range(k)], reducer=Reducer(job=job))
        return _resnet_state(strategy, layout, _batches("float64", BATCHNORM_SIZES))
    results, servers = in_threads(workers, work)
    return results, [key for key, _ in servers.pushed if 10000 <= key < 30000]


def _close(got, want, rtol):
    """Each array within ``rtol`` of its want's scale, a scale at least 1e-3 (a bias right before BatchNorm has no
    gradient and stays at 0 up to rounding)."""
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=rtol * max(np.abs(w).max(), 1e-3))


@pytest.mark.parametrize("name", sorted(BATCHNORM_JOBS))
def test_batchnorm_over_a_job_s_workers_trains_the_one_process_model(name, threads_reduce_at_once):
    """Every worker ends with the one-process model's parameters and running statistics (float64, within 1e-12 of
    each array's scale; MXNet's own BatchNorm, which a process runs on a shard alone, keeps its running statistics
    to float32's precision),
    the same bits on every worker; each BatchNorm is summed over the workers once forward and once backward a
    (micro-)batch (no backward for a micro-batch empty on every worker), recomputed or not (a recomputation takes
    the forward's sums again), under keys of their own."""
    layout, k, workers, reference, contexts_of_reference = BATCHNORM_JOBS[name]
    net = small_resnet()
    net.cast("float64")
    batches = _regrouped(_batches("float64", BATCHNORM_SIZES), workers * k, layout.accumulate)
    want = _resnet_state(make_strategy(reference, net, contexts(contexts_of_reference)), reference, batches)
    results, keys = _batchnorm_job(name)
    for params, aux in results:
        assert_same_arrays([params, aux], results[0])
        _close(params, want[0], 1e-12)
        _close(aux, want[1], 1e-6)   # a shard alone in a process runs MXNet's BatchNorm: float32's statistics
    gathers = [layout.micro * min(layout.accumulate, n) for n in BATCHNORM_SIZES]   # a step's forwards a BatchNorm
    # and of them those with an example on some worker, each with a backward round (an empty one has none)
    backward = [sum(min(layout.micro, c) for c in shard_sizes(n, min(layout.accumulate, n))) for n in BATCHNORM_SIZES]
    assert len(set(keys)) == 5 * 2 * max(gathers)   # the stem's, two in each residual block; forward and backward
    assert len(keys) == workers * 5 * (sum(gathers) + sum(backward))


def test_batchnorm_statistics_per_worker_are_another_model(threads_reduce_at_once):
    """Where it must be false: with ``job.statistics = "worker"`` each worker normalises its own slice, nothing of
    BatchNorm is summed, and the model parts from the one-process model (by far more than rounding)."""
    name = "data, 2 workers x 1 context"
    results, keys = _batchnorm_job(name, statistics="worker")
    synced, _ = _batchnorm_job(name)
    assert keys == []
    with pytest.raises(AssertionError):
        _close(results[0][0], synced[0][0], 1e-3)


def test_a_net_made_where_a_freed_net_lay_gathers_under_keys_of_its_own():
    """BatchNorm's gathers are named by their net: a ``GluonNet`` made at a freed one's address (CPython reuses it,
    the same ``id``) gets keys of its own. Named by ``id``, it took the freed net's keys where the allocator reused
    the address and not elsewhere: a 3-worker job under the launcher hung in its first step, one worker summing
    under the keys of the net it had freed, the others under new ones."""
    from mxnet import autograd
    from parallel import GluonNet, get_params
    from parallel.comm.statistics import across_workers

    def work(job, rank):
        net = small_resnet()
        params, X = get_params(net, mx.cpu(rank)), mx.nd.ones((2, 1, 28, 28), ctx=mx.cpu(rank))
        made, addresses, allsum = [], set(), job.allsum
        job.allsum = lambda key, *args, **kwargs: (made[-1].add(key), allsum(key, *args, **kwargs))[1]
        for _ in range(30):
            gluon_net = GluonNet(net)
            repeated = id(gluon_net) in addresses
            addresses.add(id(gluon_net))
            made.append(set())
            with across_workers(job), autograd.record():
                gluon_net.forward_all([X], [params])[0].wait_to_read()
            del gluon_net
            if repeated:
                return made
        raise AssertionError("no net was made at a freed net's address: the case is not tested")

    made = in_threads(1, work)[0][0]
    assert [len(keys) for keys in made] == [5] * len(made)   # each BatchNorm's forward round
    assert len(set().union(*made)) == 5 * len(made)          # under keys of its own


def test_only_a_forward_that_is_recomputed_keeps_what_batchnorm_gathered():
    """A block off the tape keeps each gather for its recomputation, which takes them in order; a block on the tape,
    never run again, keeps nothing (its buffers would live until the pending forward is dropped)."""
    from parallel.comm.statistics import Gathers
    recomputed, once = Gathers(), Gathers(recomputed=False)
    for gathers in (recomputed, once):
        gathers.keep("bn", ("first", (10000, 10001)))
        gathers.keep("bn", ("second", (10002, 10003)))
    assert [recomputed.take("bn"), recomputed.take("bn"), recomputed.take("bn")] == \
        [("first", (10000, 10001)), ("second", (10002, 10003)), None]
    assert once.take("bn") is None
