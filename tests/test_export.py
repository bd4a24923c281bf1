"""parallel.export: the from-scratch LeNet as MXNet's symbol + params pair and as a gluon network.

The reference is ``lenet(X, params)`` itself: whatever MXNet loads must predict what it predicts.
"""
import os
import tempfile
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

from parallel.models import LENET_PARAM_NAMES
from parallel.export import export_lenet, lenet_symbol, to_gluon
from parallel.models import LENET_SHAPES, init_lenet_params, lenet


@pytest.fixture(scope="module")
def params():
    # Not the near-zero default init: with scale 0.3 the logits differ clearly between classes.
    return init_lenet_params(seed=3, scale=0.3)


@pytest.fixture(scope="module")
def X():
    return mx.nd.array(np.random.RandomState(0).rand(16, 1, 28, 28))


def assert_predicts_like_lenet(out, X, params):
    """``out`` equals ``lenet(X, params)`` to rtol 1e-5 (atol relative to the logits' scale); same argmax."""
    want = lenet(X, params).asnumpy()
    got = out.asnumpy()
    assert len(set(want.argmax(axis=1))) > 1, "the reference predicts one class for all: a weak test"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))


def imports(symbol_file, params_file, ctx):
    with warnings.catch_warnings():   # MXNet: "Cannot decide type for ... data" (the input has no dtype yet)
        warnings.simplefilter("ignore", UserWarning)
        return gluon.SymbolBlock.imports(symbol_file, ["data"], params_file, ctx=ctx)


def listing(directory):
    return sorted(os.listdir(directory))


def test_names_are_the_symbols_arguments_in_lenet_order():
    sym = lenet_symbol()
    assert len(LENET_PARAM_NAMES) == len(LENET_SHAPES) == 8
    assert sym.list_arguments() == ["data", *LENET_PARAM_NAMES]
    arg_shapes, out_shapes, _ = sym.infer_shape(data=(5, 1, 28, 28), **dict(zip(LENET_PARAM_NAMES, LENET_SHAPES)))
    assert arg_shapes[1:] == LENET_SHAPES and out_shapes == [(5, 10)]
    assert lenet_symbol().tojson() == sym.tojson(), "two calls must build the same graph (same operator names)"


@pytest.mark.parametrize("ctx", [mx.cpu(0), mx.cpu(1), [mx.cpu(0), mx.cpu(1)]], ids=["cpu0", "cpu1", "cpu0+1"])
def test_symbolblock_imports_predicts_what_lenet_predicts(tmp_path, params, X, ctx):
    symbol_file, params_file = export_lenet(params, tmp_path / "lenet")
    assert (symbol_file, params_file) == (f"{tmp_path}/lenet-symbol.json", f"{tmp_path}/lenet-0000.params")
    net = imports(symbol_file, params_file, ctx)
    for c in ctx if isinstance(ctx, list) else [ctx]:
        out = net(X.as_in_context(c))
        assert out.context == c
        assert_predicts_like_lenet(out, X, params)


def test_export_takes_params_from_any_context(tmp_path, params, X):
    on_cpu1 = [p.as_in_context(mx.cpu(1)) for p in params]
    net = imports(*export_lenet(on_cpu1, str(tmp_path / "lenet")), mx.cpu(0))
    assert_predicts_like_lenet(net(X), X, params)


def test_float64_params_export_as_float64(tmp_path, params, X):
    params64 = [p.astype("float64") for p in params]
    net = imports(*export_lenet(params64, tmp_path / "lenet"), mx.cpu())
    out = net(X.astype("float64"))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out.asnumpy(), lenet(X.astype("float64"), params64).asnumpy(), rtol=1e-12)


def test_load_checkpoint_round_trip_is_bit_identical(tmp_path, params, X):
    prefix = str(tmp_path / "net")
    _, params_file = export_lenet(params, prefix, epoch=7)
    assert params_file.endswith("net-0007.params")
    assert set(mx.nd.load(params_file)) == {f"arg:{n}" for n in LENET_PARAM_NAMES}   # Module's layout
    sym, arg_params, aux_params = mx.model.load_checkpoint(prefix, 7)
    assert aux_params == {}
    assert sym.list_arguments() == ["data", *LENET_PARAM_NAMES]
    assert sorted(arg_params) == sorted(LENET_PARAM_NAMES)
    for name, p in zip(LENET_PARAM_NAMES, params):
        assert arg_params[name].shape == p.shape and arg_params[name].dtype == p.dtype
        np.testing.assert_array_equal(arg_params[name].asnumpy(), p.asnumpy())
    # the loaded symbol runs like lenet
    exe = sym.bind(mx.cpu(), {"data": X, **arg_params})
    assert_predicts_like_lenet(exe.forward()[0], X, params)


def test_export_leaves_exactly_the_pair_and_replaces_an_old_one(tmp_path, monkeypatch, params):
    scratch = tmp_path / "scratch"   # where mx.nd.save writes before the bytes go to the target
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "out"
    out.mkdir()
    export_lenet(init_lenet_params(seed=1), out / "lenet")
    export_lenet(params, out / "lenet")
    assert listing(out) == ["lenet-0000.params", "lenet-symbol.json"]   # no temporary files left
    assert listing(scratch) == []
    _, arg_params, _ = mx.model.load_checkpoint(str(out / "lenet"), 0)
    np.testing.assert_array_equal(arg_params["conv1_weight"].asnumpy(), params[0].asnumpy())


def test_a_failed_export_leaves_the_old_file_whole(tmp_path, monkeypatch, params):
    symbol_file, _ = export_lenet(params, tmp_path / "lenet")
    before = open(symbol_file).read()

    class Broken:
        def tojson(self):
            raise RuntimeError("disk full")
    monkeypatch.setattr("parallel.export.lenet_symbol", lambda: Broken())
    with pytest.raises(RuntimeError, match="disk full"):
        export_lenet(params, tmp_path / "lenet")
    assert open(symbol_file).read() == before
    assert listing(tmp_path) == ["lenet-0000.params", "lenet-symbol.json"]


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_to_gluon_predicts_what_lenet_predicts(params, X, hybridize):
    ctx_list = [mx.cpu(0), mx.cpu(1)]
    net = to_gluon(params, ctx=ctx_list)
    assert [type(b).__name__ for b in net] == ["Conv2D", "AvgPool2D", "Conv2D", "AvgPool2D", "Dense", "Dense"]
    assert net[4].weight.shape == (128, 800)   # gluon's (units, in_units): the transpose of dense1_weight
    if hybridize:
        net.hybridize()
    for c in ctx_list:
        out = net(X.as_in_context(c))
        assert out.context == c
        assert_predicts_like_lenet(out, X, params)


def test_to_gluon_copies_the_params(X):
    params = init_lenet_params(seed=3, scale=0.3)
    net = to_gluon(params)   # default context: mx.cpu()
    assert net[0].weight.list_ctx() == [mx.cpu()]
    before = net(X).asnumpy()
    params[0][:] = 0
    np.testing.assert_array_equal(net(X).asnumpy(), before)


def test_to_gluon_float64(params, X):
    params64 = [p.astype("float64") for p in params]
    out = to_gluon(params64)(X.astype("float64"))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out.asnumpy(), lenet(X.astype("float64"), params64).asnumpy(), rtol=1e-12)


def _bad_params(kind):
    params = init_lenet_params(seed=0)
    if kind == "seven":
        return params[:7]
    if kind == "shape":
        params[4] = mx.nd.zeros((128, 800))
    elif kind == "nan":
        params[2][0, 0, 0, 0] = np.nan
    elif kind == "inf":
        params[7][3] = np.inf
    elif kind == "numpy":
        params[1] = params[1].asnumpy()
    elif kind == "int":
        params[5] = params[5].astype("int32")
    elif kind == "mixed":
        params[0] = params[0].astype("float64")
    elif kind == "dict":
        return dict(zip(LENET_PARAM_NAMES, params))
    return params


BAD_PARAMS = [
    ("seven", ValueError, r"LeNet has 8 parameters .* got 7"),
    ("shape", ValueError, r"params\[4\] \(dense1_weight\) has shape \(128, 800\), expected \(800, 128\)"),
    ("nan", ValueError, r"params\[2\] \(conv2_weight\) holds 1 non-finite"),
    ("inf", ValueError, r"params\[7\] \(dense2_bias\) holds 1 non-finite"),
    ("numpy", TypeError, r"params\[1\] \(conv1_bias\) must be an NDArray, got ndarray"),
    ("int", TypeError, r"params\[5\] \(dense1_bias\) has dtype int32"),
    ("mixed", TypeError, r"params mix dtypes \['float32', 'float64'\]"),
    ("dict", TypeError, r"params must be a list .* got dict"),
]


@pytest.mark.parametrize("kind, error, message", BAD_PARAMS, ids=[b[0] for b in BAD_PARAMS])
def test_export_refuses_bad_params_and_writes_nothing(tmp_path, kind, error, message):
    with pytest.raises(error, match=message):
        export_lenet(_bad_params(kind), tmp_path / "lenet")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("kind, error, message", BAD_PARAMS, ids=[b[0] for b in BAD_PARAMS])
def test_to_gluon_refuses_bad_params(kind, error, message):
    with pytest.raises(error, match=message):
        to_gluon(_bad_params(kind))


@pytest.mark.parametrize("prefix, epoch, error, message", [
    ("missing/lenet", 0, ValueError, r"directory '.*missing' does not exist; create it first"),
    ("", 0, ValueError, r"prefix '.*/' names a directory"),
    ("lenet", -1, ValueError, r"epoch must be between 0 and 9999 .* got -1"),
    ("lenet", 1.0, TypeError, r"epoch must be an int, got float"),
], ids=["missing-dir", "dir-prefix", "negative-epoch", "float-epoch"])
def test_export_refuses_bad_prefix_or_epoch(tmp_path, prefix, epoch, error, message):
    with pytest.raises(error, match=message):
        export_lenet(init_lenet_params(seed=0), os.path.join(str(tmp_path), prefix), epoch=epoch)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("ctx", [[], "cpu", [mx.cpu(), "cpu(1)"]])
def test_to_gluon_refuses_a_bad_ctx(ctx):
    with pytest.raises(TypeError, match="ctx must be a Context or a non-empty list"):
        to_gluon(init_lenet_params(seed=0), ctx=ctx)


# ResNet-18 (11 M parameters exported four times) is the slow tier's, as its other runs are; the ViT and the
# Transformer prove the naming in the fast tier.
@pytest.mark.parametrize("model", [pytest.param("resnet18", marks=pytest.mark.slow), "vit", "transformer"])
def test_every_instance_of_a_model_exports_the_same_names(tmp_path, model):
    """gluon names a block's arrays by the instances made so far unless it has a prefix: an exported ViT was
    hybridsequential0_... after a straight run and hybridsequential1_... after a resumed one (which builds the
    model twice). Every instance of the package's models now names its arrays alike, and exports alike."""
    import json
    from parallel.export import export_gluon
    from parallel.models import MODELS
    init = MODELS[model].behaviour.init
    names = []
    for i in range(2):
        block = init(seed=i)
        names.append([param.name for param in block.collect_params().values()])
        symbol_file, params_file = export_gluon(block, str(tmp_path / f"{model}{i}"))
        names.append(sorted(mx.nd.load(params_file)))
        names.append([node["name"] for node in json.load(open(symbol_file))["nodes"]])
    assert names[:3] == names[3:] and names[0][0].startswith(f"{model}_"), names[0][:2]
