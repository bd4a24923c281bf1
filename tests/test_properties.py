"""Property-based tests (Hypothesis) of the primitives' contracts: ``split_and_load``, ``shard_sizes``,
``allreduce`` and ``parse_devices``, on generated input.

How many examples each test draws comes from the Hypothesis profile (``conftest.py``): a few by default, many
and derandomized in the slow tier (``--hypothesis-profile=full``); no deadline, since MXNet calls vary in time.
"""
import re
import sys

import mxnet as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from parallel import ALLREDUCE_ALGORITHMS, allreduce, parse_devices, shard_sizes, split_and_load
from parallel.devices import MAX_CPU_CONTEXTS
from conftest import contexts

DTYPES = [np.float32, np.float64, np.int32]
ALGORITHMS = sorted(ALLREDUCE_ALGORITHMS)

# Characters str.isdigit() accepts besides 0-9: Arabic-Indic '٣', superscript '²', fullwidth '３', ...
UNICODE_DIGITS = [chr(c) for c in range(128, sys.maxunicode + 1) if chr(c).isdigit()]


def _elements(dtype):
    """Any finite value of ``dtype`` (no NaN or infinity, which would make "equal" meaningless)."""
    if np.dtype(dtype).kind == "i":
        return st.integers(np.iinfo(dtype).min, np.iinfo(dtype).max)
    return st.floats(allow_nan=False, allow_infinity=False, width=np.dtype(dtype).itemsize * 8)


@st.composite
def batches(draw, min_n=1, max_n=40):
    """A batch: numpy array or NDArray, ``n`` examples of a trailing shape of 0-3 dims of size 1-4."""
    n = draw(st.integers(min_n, max_n))
    trailing = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    values = draw(hnp.arrays(dtype, (n,) + trailing, elements=_elements(dtype)))
    as_ndarray = draw(st.booleans())
    return (mx.nd.array(values, dtype=dtype) if as_ndarray else values), values


@pytest.mark.property
@given(batch=batches(), k=st.integers(1, 9))
def test_split_and_load_contract(batch, k):
    """For any batch of n >= 1 examples and K contexts: exactly min(n, K) shards, shard i on context i,
    sizes within one of each other summing to n (``shard_sizes``), the dtype and trailing shape kept, and
    the shards concatenated give the input back bit for bit."""
    data, values = batch
    ctx_list = contexts(k)
    shards = split_and_load(data, ctx_list)
    n = values.shape[0]
    assert isinstance(shards, list) and len(shards) == min(n, k)
    sizes = [shard.shape[0] for shard in shards]
    assert sizes == shard_sizes(n, k)
    assert sum(sizes) == n and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    for i, shard in enumerate(shards):
        assert isinstance(shard, mx.nd.NDArray)
        assert shard.context == ctx_list[i]
        assert shard.dtype == values.dtype
        assert shard.shape[1:] == values.shape[1:]
    joined = np.concatenate([shard.asnumpy() for shard in shards])
    assert joined.dtype == values.dtype and joined.shape == values.shape
    assert joined.tobytes() == values.tobytes()


@pytest.mark.property
@given(n=st.integers(1, 10 ** 6), k=st.integers(1, 2000))
@example(n=256, k=6)
@example(n=1, k=2000)
def test_shard_sizes_contract(n, k):
    """``shard_sizes(n, k)`` for any n, k >= 1: min(n, k) positive sizes summing to n, differing by at most
    one, the larger ones first."""
    sizes = shard_sizes(n, k)
    assert len(sizes) == min(n, k)
    assert sum(sizes) == n and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert all(isinstance(size, int) for size in sizes)


@pytest.mark.property
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=4).filter(lambda s: 0 in s),
       dtype=st.sampled_from(DTYPES), as_ndarray=st.booleans(), k=st.integers(1, 9))
@example(shape=[0, 5], dtype=np.float32, as_ndarray=True, k=1)
@example(shape=[0, 3], dtype=np.float32, as_ndarray=False, k=2)
@example(shape=[3, 0], dtype=np.float32, as_ndarray=False, k=2)
def test_split_and_load_refuses_empty_input_with_value_error(shape, dtype, as_ndarray, k):
    """An array with no values (an empty batch, n = 0, or examples with a 0 in their shape) raises a
    ValueError saying what is wrong, never an MXNetError from deep inside MXNet; an empty batch says
    "empty batch"."""
    values = np.zeros(shape, dtype=dtype)
    data = mx.nd.array(values, dtype=dtype) if as_ndarray else values
    with pytest.raises(ValueError) as info:
        split_and_load(data, contexts(k))
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert ("empty batch" if shape[0] == 0 else "holds no values") in message


@st.composite
def allreduce_inputs(draw):
    """K (1-6) arrays of one shape (1-3 dims, 1-300 elements, sometimes fewer than K) and dtype, bounded values."""
    k = draw(st.integers(1, 6))
    shape, budget = [], 300
    for _ in range(draw(st.integers(1, 3))):
        side = draw(st.integers(1, budget))
        shape.append(side)
        budget //= side
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    elements = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=np.dtype(dtype).itemsize * 8)
    values = draw(hnp.arrays(dtype, (k,) + tuple(shape), elements=elements))
    return values


@pytest.mark.property
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(algorithm=st.sampled_from(ALGORITHMS), values=allreduce_inputs())
@example(algorithm="ring", values=np.arange(1.0, 6.0, dtype=np.float32).reshape(5, 1))   # 1 element, K = 5
@example(algorithm="ring", values=np.arange(18.0).reshape(6, 3))                        # 3 elements, K = 6
@example(algorithm="tree", values=np.ones((5, 2, 1), dtype=np.float32))
def test_allreduce_contract(algorithm, values, strict_contexts):
    """For every algorithm, any K and shape (even fewer elements than K, so ring chunks are empty): every
    array ends equal to the sum of the inputs (float64 to 1e-12, float32 to 1e-5 relative, with an absolute
    slack scaled by the magnitude of the terms), all arrays are bit-identical, each stays on its own context
    with its shape and dtype, the list returned is the one given, and no operator mixes two contexts."""
    k, dtype = values.shape[0], values.dtype
    arrays = [mx.nd.array(values[i], ctx=mx.cpu(i), dtype=dtype) for i in range(k)]
    result = allreduce(arrays, algorithm)
    assert result is arrays
    got = [array.asnumpy() for array in arrays]
    want = values.astype(np.float64).sum(axis=0)
    scale = np.abs(values.astype(np.float64)).sum(axis=0).max()
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    for i, array in enumerate(arrays):
        assert array.context == mx.cpu(i)
        assert array.shape == values.shape[1:] and array.dtype == dtype
        np.testing.assert_allclose(got[i], want, rtol=rtol, atol=rtol * scale)
        assert got[i].tobytes() == got[0].tobytes()


@pytest.mark.property
@given(k=st.integers(2, 6), data=st.data())
def test_allreduce_refuses_mismatches(k, data):
    """A different shape, a different dtype or a context used twice raises ValueError naming the
    offending index, for every algorithm, before any array is modified."""
    algorithm = data.draw(st.sampled_from(ALGORITHMS))
    bad = data.draw(st.integers(1, k - 1), label="bad index")
    fault = data.draw(st.sampled_from(["shape", "dtype", "context"]))
    shapes = [(3, 2)] * k
    dtypes = [np.float32] * k
    ctxs = contexts(k)
    if fault == "shape":
        shapes[bad] = data.draw(st.sampled_from([(2, 3), (6,), (3, 2, 1), (4, 2)]))
    elif fault == "dtype":
        dtypes[bad] = data.draw(st.sampled_from([np.float64, np.int32, np.float16]))
    else:
        ctxs[bad] = ctxs[data.draw(st.integers(0, bad - 1), label="same context as")]
    arrays = [mx.nd.full(shapes[i], i + 1, ctx=ctxs[i], dtype=dtypes[i]) for i in range(k)]
    before = [array.asnumpy().copy() for array in arrays]
    with pytest.raises(ValueError, match=rf"arrays\[{bad}\]"):
        allreduce(arrays, algorithm)
    for array, old in zip(arrays, before):
        np.testing.assert_array_equal(array.asnumpy(), old)


_VALID_CPU = re.compile(r"cpu(?::([0-9]+))?")


def _expected_contexts(spec):
    """What ``parse_devices`` must return on a machine without a GPU, or None where it must raise: 'auto'
    and 'cpu' give [cpu(0)], 'cpu:N' (ASCII digits, 1 <= N <= MAX_CPU_CONTEXTS) gives N contexts; case and
    surrounding whitespace do not matter."""
    text = spec.strip().lower()
    if text == "auto":
        return [mx.cpu(0)]
    match = _VALID_CPU.fullmatch(text)
    if not match:
        return None
    digits = (match.group(1) or "1").lstrip("0") or "0"
    if len(digits) > 4 or not 1 <= int(digits) <= MAX_CPU_CONTEXTS:
        return None
    return [mx.cpu(i) for i in range(int(digits))]


def _check_parse(spec):
    """Either a non-empty list of distinct contexts, or ValueError/TypeError with a one-line message of
    ours (naming the spec); on a machine without a GPU, exactly what ``_expected_contexts`` says."""
    try:
        result = parse_devices(spec)
    except (ValueError, TypeError) as error:
        message = str(error)
        assert len(message.splitlines()) == 1, repr(message)
        assert "device spec" in message, repr(message)       # not a bare message from int() or MXNet
        result = None
    else:
        assert isinstance(result, list) and result
        assert all(isinstance(ctx, mx.Context) for ctx in result)
        assert len(set(result)) == len(result)
    if mx.context.num_gpus() == 0:
        assert result == _expected_contexts(spec)
    return result


_NUMBERS = st.one_of(st.integers(-3, 2 * MAX_CPU_CONTEXTS).map(str), st.integers(0, 10 ** 30).map(str),
                     st.sampled_from(["", " ", "1e3", "3.0", "+3", "0x10", "00", "007", "9" * 5000]),
                     st.text(st.sampled_from(UNICODE_DIGITS), min_size=1, max_size=3),
                     st.text(st.sampled_from("0123456789٣²,-+e ."), max_size=6))


@st.composite
def near_valid_specs(draw):
    """Specs close to valid ones: cpu/gpu/auto in any case, padded, with or without ':' and a count or
    index list that may be empty, negative, huge, float-like, or written in non-ASCII digits."""
    kind = draw(st.sampled_from(["cpu", "gpu", "CPU", "Gpu", "auto", "tpu", "cpux", ""]))
    colon = draw(st.sampled_from(["", ":", ":", ": ", "::"]))
    args = draw(st.lists(_NUMBERS, min_size=1, max_size=3))
    pad = draw(st.sampled_from(["", " ", "\t", "\n", " \n"]))
    return pad + kind + colon + ",".join(args) + pad


@pytest.mark.property
@given(spec=st.one_of(st.text(), near_valid_specs()))
@example(spec="cpu:")
@example(spec="gpu:")
@example(spec="cpu:0")
@example(spec="cpu:-1")
@example(spec=" CPU:3 ")
@example(spec="gpu:0,,1")
@example(spec="cpu:1e3")
@example(spec="cpu:٣")
@example(spec="cpu:²")
@example(spec="gpu:²")
@example(spec="cpu:" + "9" * 5000)
def test_parse_devices_returns_contexts_or_a_clear_error(spec):
    """For any string: a non-empty list of distinct contexts, or a ValueError/TypeError with a one-line
    message naming the spec; never another exception. Without a GPU, exactly the valid specs ('auto',
    'cpu', 'cpu:N' in ASCII digits with 1 <= N <= MAX_CPU_CONTEXTS, any case and padding) are accepted,
    so 'cpu:', 'gpu:', 'cpu:٣', 'cpu:1e3' and the like raise."""
    _check_parse(spec)


@pytest.mark.property
@given(kind=st.sampled_from(["cpu:", "gpu:"]), digits=st.text(st.sampled_from(UNICODE_DIGITS), min_size=1,
                                                               max_size=3))
def test_parse_devices_refuses_non_ascii_digits(kind, digits):
    """Digits other than ASCII 0-9 (which ``str.isdigit`` accepts: '٣', '²', '３') raise ValueError."""
    with pytest.raises(ValueError, match="digits 0-9"):
        parse_devices(kind + digits)


@pytest.mark.property
@given(n=st.integers(1, 64), upper=st.booleans(), left=st.sampled_from(["", " ", "\t"]),
       right=st.sampled_from(["", " ", "\n"]), zeros=st.sampled_from(["", "0", "00"]))
def test_parse_devices_cpu_n_gives_n_contexts(n, upper, left, right, zeros):
    """``cpu:N`` for 1 <= N <= MAX_CPU_CONTEXTS gives cpu(0) .. cpu(N-1), whatever the case, the padding and
    leading zeros."""
    spec = left + ("CPU" if upper else "cpu") + ":" + zeros + str(n) + right
    assert parse_devices(spec) == [mx.cpu(i) for i in range(n)]


@pytest.mark.property
@given(n=st.one_of(st.integers(MAX_CPU_CONTEXTS + 1, 10 ** 40), st.just(MAX_CPU_CONTEXTS + 1)))
def test_parse_devices_caps_cpu_contexts(n):
    """More CPU contexts than MAX_CPU_CONTEXTS raise ValueError naming the limit (MXNet refuses device
    ids from 2**31 on and allocates per-device tables up to the largest id), without building a list."""
    with pytest.raises(ValueError, match=f"at most {MAX_CPU_CONTEXTS}"):
        parse_devices(f"cpu:{n}")


@pytest.mark.property
@given(spec=st.one_of(st.none(), st.integers(), st.floats(), st.binary(), st.lists(st.text(), max_size=2),
                      st.builds(mx.cpu, st.integers(0, 3))))
def test_parse_devices_refuses_non_strings_with_type_error(spec):
    """Anything but a string raises TypeError."""
    with pytest.raises(TypeError, match="must be a string"):
        parse_devices(spec)
