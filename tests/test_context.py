"""Context parallelism (issue 39): ring attention against attention over the whole sequence (outputs and
gradients), its bytes against their formula, the CLI, and (slow tier) one epoch of the digits with the sequence
split. That the ViT of 50 tokens (``patch=4``) trained with its sequence split over 2 and 4 contexts is the
one-context model is proved once, by ``tests/test_layouts.py``'s context cells.
"""
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from parallel import Layout
from parallel.comm import algorithms
from parallel.comm.algorithms import chunk_bounds
from parallel.models.ring import attention, ring_attention, ring_bytes
from parallel.models.vit import init_vit
from parallel.strategies import make_strategy
from parallel.train import main
from conftest import assert_refused, contexts, easy_dataset, write_idx_files


def _attention_and_grads(q, k, v, C):
    """Ring attention of ``q, k, v`` cut into C slices of the sequence (one a context), its output joined, and the
    gradients of ``sum(out * w)`` for the whole ``q, k, v`` (joined from the slices)."""
    bounds = chunk_bounds(q.shape[1], C)
    parts = [[x[:, a:b].copyto(mx.cpu(i)) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))] for x in (q, k, v)]
    for part in parts:
        for x in part:
            x.attach_grad()
    w = mx.nd.random.normal(shape=q.shape, dtype=q.dtype)
    with autograd.record():
        outs = ring_attention(*parts, scale=0.35)
        heads = [(o * w[:, a:b].as_in_context(o.context)).sum() for o, a, b in zip(outs, bounds, bounds[1:])]
    autograd.backward(heads)
    joined = mx.nd.concat(*[o.as_in_context(mx.cpu()) for o in outs], dim=1)
    grads = [mx.nd.concat(*[x.grad.as_in_context(mx.cpu()) for x in part], dim=1) for part in parts]
    return joined, grads, w


@pytest.mark.parametrize("C, length", [(1, 9), (2, 50), (3, 50), (4, 50), (4, 6)])
def test_ring_attention_is_attention_over_the_whole_sequence_outputs_and_gradients(C, length):
    mx.random.seed(C)
    q, k, v = (mx.nd.random.normal(shape=(6, length, 8), dtype="float64") for _ in range(3))
    out, grads, w = _attention_and_grads(q, k, v, C)
    whole = [x.copy() for x in (q, k, v)]
    for x in whole:
        x.attach_grad()
    with autograd.record():
        want = attention(*whole, scale=0.35)
        (want * w).sum().backward()
    np.testing.assert_allclose(out.asnumpy(), want.asnumpy(), rtol=1e-12, atol=1e-12)
    for got, x in zip(grads, whole):
        np.testing.assert_allclose(got.asnumpy(), x.grad.asnumpy(), rtol=1e-10, atol=1e-12)


def test_ring_attention_in_float32_is_attention_to_float32_rounding_and_an_offline_softmax_is_not_it():
    """The online softmax's rescaling is what makes the blocks add up: summing each block's own softmax (no
    rescaling) is not attention."""
    mx.random.seed(0)
    q, k, v = (mx.nd.random.normal(shape=(4, 50, 16)) for _ in range(3))
    out, _, _ = _attention_and_grads(q, k, v, 4)
    want = attention(q, k, v, scale=0.35)
    scale = np.abs(want.asnumpy()).max()
    assert np.abs(out.asnumpy() - want.asnumpy()).max() < 1e-5 * scale
    bounds = chunk_bounds(50, 4)
    naive = sum(attention(q, k[:, a:b], v[:, a:b], scale=0.35) for a, b in zip(bounds, bounds[1:]))
    assert np.abs(naive.asnumpy() - want.asnumpy()).max() > 0.1 * scale


@pytest.mark.parametrize("k, C", [(2, 2), (4, 4), (4, 2)])
def test_the_ring_moves_its_formula_s_bytes(k, C):
    """A forward of 8 examples: each of the 4 blocks' keys and values (8 x 4 heads, 50 tokens, width 16) travel
    C - 1 hops round each group; then the head's gather gives each member the C - 1 slices of the tokens (width 64)
    it does not hold; the images' copies to the members are not the ring's (not counted)."""
    strategy = make_strategy(Layout(context=C), init_vit(0, patch=4), contexts(k))
    X = mx.nd.random.normal(shape=(8, 1, 28, 28))
    before = algorithms.copied_bytes()
    strategy.evaluate([(X, mx.nd.zeros((8,)))])
    per_group = 8 // (k // C)
    gather = (k // C) * (C - 1) * per_group * 50 * 64 * 4
    assert algorithms.copied_bytes() - before == 4 * (k // C) * ring_bytes(per_group * 4, 50, 16, C) + gather


def test_layouts_context_parallelism_cannot_take_are_refused():
    with pytest.raises(ValueError, match="cannot group 3"):
        make_strategy(Layout(context=2), init_vit(0, patch=4), contexts(3))


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_cli_trains_with_the_sequence_split_and_resumes_on_one_context(tmp_path, capsys):
    """The CLI's path to the layout (what it trains is ``test_layouts.py``'s): 64 examples, 2 batches an epoch."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=1))
    common = ["--model", "vit", "--patch-size", "4", "--data-dir", str(data_dir), "--batch-size", "32",
              "--optimizer", "adamw", "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*common, "--context", "2", "--devices", "cpu:4", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "training ViT (4x4 patches)" in out
    assert "4 replicas: " in out and "each example's tokens split over groups of 2 replicas (attention by ring" in out
    assert main([*common, "--devices", "cpu:1", "--epochs", "2", "--resume"]) == 0
    assert "epoch 2," in capsys.readouterr().out


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_cli_splits_each_member_s_tokens_over_its_tensor_ranks_with_sequence_parallelism(tmp_path, capsys):
    """``--context 2 --tensor 2 --sequence-parallel`` (issue 46; what it trains is ``test_layouts.py``'s): each
    member's 25 of the 50 tokens split 13 and 12 over its ranks, what each context keeps of a batch of 32's layer
    norms' inputs and residual stream (3 a block, 4 blocks, width 64, float32)."""
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=1))
    metrics = tmp_path / "m.json"
    assert main(["--model", "vit", "--patch-size", "4", "--data-dir", str(data_dir), "--batch-size", "32",
                 "--epochs", "1", "--no-progress", "--context", "2", "--tensor", "2", "--sequence-parallel",
                 "--devices", "cpu:4", "--metrics-json", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert "2 replicas x 2 tensor ranks" in out and "split over groups of 2 replicas" in out
    assert "sequence parallel: layer norms and the residual stream split" in out
    rows = json.loads(metrics.read_text())[0]["memory"]
    replicated = {row["context"]: row["activations"]["replicated"] for row in rows}
    # context (member c, rank t) = cpu(2 c + t) (parallel.mesh): rank 0 of each member 13 tokens, rank 1 12
    assert replicated == {f"cpu({i})": 3 * 4 * 32 * n * 64 * 4 for i, n in enumerate((13, 12, 13, 12))}


@pytest.mark.slow
def test_the_cli_splits_the_sequence_across_pipeline_stages_with_zero_3_and_over_tensor_ranks(easy_dir, tmp_path, capsys):
    """Context parallelism composed (issue 39): across 2 pipeline stages fed 2 micro-batches, with ZeRO-3 (each
    member a replica its shards are spread over), over tensor ranks, and with experts spread over expert-parallel
    groups (issue 46)."""
    common = ["--model", "vit", "--patch-size", "4", "--context", "2", "--data-dir", str(easy_dir), "--batch-size",
              "32", "--epochs", "1", "--no-progress"]
    assert main([*common, "--strategy", "pipeline", "--stages", "2", "--micro-batches", "2", "--devices",
                 "cpu:4"]) == 0
    out = capsys.readouterr().out
    assert "2 replicas x 2 stages" in out and "each example's tokens split over groups of 2 replicas" in out
    assert main([*common, "--zero", "3", "--devices", "cpu:2"]) == 0
    out = capsys.readouterr().out
    assert "each context keeps 1/2 of the parameters" in out and "ZeRO-3: parameters, gradients" in out
    assert main([*common, "--tensor", "2", "--devices", "cpu:4"]) == 0
    assert "2 replicas x 2 tensor ranks" in capsys.readouterr().out
    assert main([*common, "--experts", "4", "--expert-parallel", "2", "--devices", "cpu:4"]) == 0   # issue 46
    out = capsys.readouterr().out
    assert "4 replicas: " in out and "split over groups of 2 replicas" in out and "2 of the 4 experts" in out


@pytest.mark.parametrize("flags, says", [
    (["--context", "2", "--model", "lenet"], "--context applies to a model's tokens; use --model vit or transformer"),
    (["--patch-size", "5"], "--patch-size must divide the image's 28 pixels"),
    (["--context", "3", "--devices", "cpu:2"], "cannot group 2 contexts"),
])
def test_bad_context_flags_get_one_line_and_status_2(flags, says, easy_dir, capsys):
    status = main(["--model", "vit", "--data-dir", str(easy_dir), "--epochs", "1", "--no-progress", *flags])
    assert_refused(status, capsys, says)
