import os

import mxnet as mx
import pytest

from parallel import parse_devices, try_all_gpus, try_gpu
from parallel.devices import MAX_CPU_CONTEXTS

HAS_GPU = mx.context.num_gpus() > 0


def test_cpu_specs():
    assert parse_devices("cpu:4") == [mx.cpu(i) for i in range(4)]
    assert parse_devices("cpu") == [mx.cpu(0)]
    assert parse_devices(" CPU:2 ") == [mx.cpu(0), mx.cpu(1)]


def test_auto_and_fallbacks():
    assert parse_devices("auto") == try_all_gpus()
    if not HAS_GPU:
        assert try_all_gpus() == [mx.cpu()]
        assert try_gpu(0) == mx.cpu()


@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_gpu_specs():
    assert parse_devices("gpu:0") == [mx.gpu(0)]
    assert parse_devices("gpu") == [mx.gpu(i) for i in range(mx.context.num_gpus())]


@pytest.mark.parametrize("spec, message", [
    ("tpu:1", "unknown device spec"),
    ("cpu:0", "N >= 1"),
    ("cpu:x", "N >= 1"),
    ("cpu:-1", "N >= 1"),
    ("gpu:a", "GPU indices"),
    ("gpu:0,0", "repeats"),
    ("gpu:99", "asks for GPU 99"),
    ("", "unknown device spec"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(spec)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
def test_gpu_without_gpu_says_so():
    with pytest.raises(ValueError, match="has none"):
        parse_devices("gpu")
    with pytest.raises(ValueError, match="sees no GPU"):
        parse_devices("gpu:0")


@pytest.mark.parametrize("spec, message", [
    ("cpu:", r"nothing after the colon; write 'cpu' for one CPU context or 'cpu:N'"),   # was [cpu(0)]
    (" CPU: ", r"nothing after the colon; write 'cpu'"),
    ("gpu:", r"nothing after the colon; write 'gpu' for every GPU or 'gpu:I,J,...'"),
])
def test_colon_with_nothing_after_it_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(spec)


@pytest.mark.parametrize("spec", ["cpu:٣", "cpu:²", "cpu:３", "cpu:1٣", "gpu:٣", "gpu:²", "gpu:0,²"])
def test_non_ascii_digits_are_refused(spec):
    # str.isdigit() takes them: 'cpu:٣' gave three contexts, 'cpu:²' an int() error naming no spec.
    with pytest.raises(ValueError, match=r"device spec .*digits 0-9"):
        parse_devices(spec)


def test_cpu_count_is_capped_before_building_a_list():
    # MXNet refuses cpu(2**31) and allocates ~15 bytes per device id up to the largest one it sees;
    # before, 'cpu:10**12' tried to build a list of 10**12 contexts.
    assert len(parse_devices(f"cpu:{MAX_CPU_CONTEXTS}")) == MAX_CPU_CONTEXTS
    for count in (str(MAX_CPU_CONTEXTS + 1), str(2 ** 31), str(10 ** 12), "1" + "0" * 5000):
        with pytest.raises(ValueError, match=rf"at most {MAX_CPU_CONTEXTS} are allowed"):
            parse_devices("cpu:" + count)


def test_huge_gpu_index_names_the_spec():
    # before: int() refused the 5000 digits with a message naming no spec
    with pytest.raises(ValueError, match="device spec"):
        parse_devices("gpu:" + "9" * 5000)


def test_spec_must_be_text():
    with pytest.raises(TypeError):
        parse_devices(4)


def test_recommended_omp_threads_use_every_core():
    from parallel import recommended_omp_threads
    assert recommended_omp_threads(cores=2) == 2     # measured: beats cores // K at K = 1, 2, 4
    assert recommended_omp_threads(cores=16) == 16
    assert recommended_omp_threads(cores=0) == 1
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert recommended_omp_threads() == available
