import mxnet as mx
import numpy as np
import pytest

from parallel import LENET_SHAPES, init_lenet_params, lenet, softmax_cross_entropy


def test_init_shapes_and_distribution():
    params = init_lenet_params(seed=0)
    assert [p.shape for p in params] == LENET_SHAPES
    weights = np.concatenate([p.asnumpy().ravel() for p in params[0::2]])
    assert abs(weights.std() - 0.01) < 0.001 and abs(weights.mean()) < 0.001
    for bias in params[1::2]:
        assert not bias.asnumpy().any()


def test_init_is_seeded():
    a, b, c = init_lenet_params(1), init_lenet_params(1), init_lenet_params(2)
    np.testing.assert_array_equal(a[0].asnumpy(), b[0].asnumpy())
    assert not np.array_equal(a[0].asnumpy(), c[0].asnumpy())
    with pytest.raises(TypeError, match="seed"):
        init_lenet_params(seed=1.5)


def test_forward_shape_and_loss():
    X = mx.nd.random.uniform(shape=(3, 1, 28, 28))
    out = lenet(X, init_lenet_params())
    assert out.shape == (3, 10)
    loss = softmax_cross_entropy(out, mx.nd.array([0, 1, 2]))
    assert loss.shape == (3,)
    # near-zero weights give near-uniform predictions: loss close to log(10)
    np.testing.assert_allclose(loss.asnumpy(), np.log(10), rtol=1e-3)


def test_same_definition_runs_as_symbol():
    data = mx.sym.var("data")
    names = [f"p{i}" for i in range(len(LENET_SHAPES))]
    out = lenet(data, [mx.sym.var(n) for n in names])
    params = init_lenet_params(seed=4)
    X = mx.nd.random.uniform(shape=(2, 1, 28, 28))
    executor = out.bind(mx.cpu(), {"data": X, **dict(zip(names, params))})
    np.testing.assert_allclose(executor.forward()[0].asnumpy(), lenet(X, params).asnumpy(), rtol=1e-5)


def test_stages_compose_to_the_whole_model():
    from parallel import LENET_LAYERS, lenet_layers
    params = init_lenet_params(seed=2)
    X = mx.nd.random.uniform(shape=(4, 1, 28, 28))
    whole = lenet(X, params).asnumpy()
    for cut in range(1, len(LENET_LAYERS)):
        h = lenet_layers(X, params[:2 * cut], 0, cut)
        np.testing.assert_array_equal(lenet_layers(h, params[2 * cut:], cut).asnumpy(), whole)
    with pytest.raises(ValueError, match="outside LeNet"):
        lenet_layers(X, params, 0, 5)
    with pytest.raises(ValueError, match="take 4 parameters, got 2"):
        lenet_layers(X, params[:2], 0, 2)


def test_cached_graph_gives_the_same_values_and_gradients():
    from mxnet import autograd
    from parallel import get_params, lenet_cached
    X = mx.nd.random.uniform(shape=(5, 1, 28, 28), ctx=mx.cpu(1))
    y = mx.nd.array([0, 1, 2, 3, 4], ctx=mx.cpu(1))
    results = []
    for net in (lenet, lenet_cached, lenet_cached):   # twice: the second call reuses the graph
        params = get_params(init_lenet_params(seed=6), mx.cpu(1))
        with autograd.record():
            out = net(X, params)
            loss = softmax_cross_entropy(out, y)
        loss.backward()
        results.append((out.asnumpy(), params.grad.asnumpy()))
    for out, grad in results[1:]:
        np.testing.assert_allclose(out, results[0][0], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(grad, results[0][1], rtol=1e-5, atol=1e-7)
    assert np.abs(results[0][1]).max() > 0


def test_cached_graph_follows_shape_and_context():
    from parallel import get_params, lenet_cached
    for ctx, n in ((mx.cpu(0), 3), (mx.cpu(2), 3), (mx.cpu(0), 7)):
        X = mx.nd.random.uniform(shape=(n, 1, 28, 28), ctx=ctx)
        params = get_params(init_lenet_params(seed=1), ctx)
        out = lenet_cached(X, params)
        assert out.shape == (n, 10) and out.context == ctx
        np.testing.assert_allclose(out.asnumpy(), lenet(X, params).asnumpy(), rtol=1e-5, atol=1e-7)


def test_cached_graphs_are_bounded_per_context_least_recently_used_first():
    from parallel import CachedNet
    net = CachedNet(lenet, max_shapes=2)
    params = init_lenet_params(seed=1)
    for n in (2, 3, 2, 4):   # shape 3 is the least recently used when shape 4 arrives
        X = mx.nd.random.uniform(shape=(n, 1, 28, 28))
        np.testing.assert_allclose(net(X, params).asnumpy(), lenet(X, params).asnumpy(), rtol=1e-5, atol=1e-7)
    assert [shape[0] for shape in net.graphs.keys(mx.cpu(0))] == [2, 4]
    assert net.graphs_built == 3


def test_cached_graphs_are_kept_for_any_number_of_contexts():
    """Nine contexts training on one batch size build nine graphs, then none: the cache holds what a run
    uses (a cache of 8 graphs in all rebuilt 180 graphs in 20 steps at 9 contexts)."""
    from parallel import CachedNet, get_params, train_batch
    net = CachedNet(lenet)
    ctx_list = [mx.cpu(i) for i in range(9)]
    device_params = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
    X, y = mx.nd.ones((18, 1, 28, 28)), mx.nd.array(np.arange(18) % 10)
    for _ in range(5):
        train_batch(X, y, device_params, ctx_list, lr=0.1, net=net)
    assert net.graphs_built == 9
    train_batch(X[:9], y[:9], device_params, ctx_list, lr=0.1, net=net)   # a last batch: one new shape each
    for _ in range(3):
        train_batch(X, y, device_params, ctx_list, lr=0.1, net=net)
    assert net.graphs_built == 18
    mx.nd.waitall()


def test_the_cached_graph_takes_other_parameter_arrays_too():
    """The graph declares the weights as parameters, bound at the first call: other arrays in a later call (a
    copy, new values) are bound anew, and the outputs and gradients follow them."""
    from mxnet import autograd
    from parallel import CachedNet, get_params
    net = CachedNet(lenet)
    X = mx.nd.random.uniform(shape=(3, 1, 28, 28))
    for seed in (1, 2, 2):
        params = get_params(init_lenet_params(seed=seed), mx.cpu())
        with autograd.record():
            out = net(X, params)
        out.backward()
        want = [p.copy() for p in params]
        for p in want:
            p.attach_grad()
        with autograd.record():
            reference = lenet(X, want)
        reference.backward()
        np.testing.assert_allclose(out.asnumpy(), reference.asnumpy(), rtol=1e-5, atol=1e-7)
        for got, expected in zip(params, want):
            np.testing.assert_allclose(got.grad.asnumpy(), expected.grad.asnumpy(), rtol=1e-4, atol=1e-7)
