import os

import mxnet as mx
import pytest

from parallel import parse_devices, try_all_gpus, try_gpu

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
