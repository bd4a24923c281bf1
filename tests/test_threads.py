"""set_omp_threads / omp_threads: argument checks here, effects in fresh processes (they are process-wide).

The effect is checked without timing: each worker thread reports OpenMP's setting back from inside the
thread (``omp_threads``); benchmarks/threads.py measures what it does to the step time.
"""
import json
import os
import sys
import textwrap

import mxnet as mx
import pytest

from conftest import run_process

from parallel.threads import on_worker_threads, omp_threads, recommended_omp_threads, set_omp_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORES = recommended_omp_threads()


def run_fresh(code, **env):
    """Run ``code`` in a fresh Python with OMP_NUM_THREADS unset plus ``env``; return the JSON it prints last."""
    environ = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MXNET_OMP_MAX_THREADS", "MXNET_CPU_WORKER_NTHREADS", "MXNET_ENGINE_TYPE"):
        environ.pop(name, None)
    environ.update(env)
    environ["PYTHONPATH"] = ROOT + os.pathsep + environ.get("PYTHONPATH", "")
    done = run_process([sys.executable, "-c", textwrap.dedent(code)], env=environ, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n, error, message", [
    (0, ValueError, "n must be >= 1, got 0"),
    (-3, ValueError, "got -3"),
    (CORES + 1, ValueError, f"more than the {CORES} cores this process may run on; use at most {CORES}"),
    (2.0, TypeError, "n must be an int, got 2.0"),
    (True, TypeError, "got True"),
    ("2", TypeError, "got '2'"),
])
def test_bad_thread_counts_are_refused(n, error, message):
    with pytest.raises(error) as info:
        set_omp_threads(n)
    assert message in str(info.value)


@pytest.mark.parametrize("ctx_list, error, message", [
    ([], ValueError, "ctx_list is empty; give the contexts you train on"),
    ("cpu:2", TypeError, "ctx_list must be a list of mxnet Contexts such as [mx.cpu(0), mx.cpu(1)], got 'cpu:2'"),
    ([mx.cpu(0), "cpu"], TypeError, "ctx_list[1] must be an mxnet Context such as mx.cpu(0), got 'cpu'"),
])
def test_bad_context_lists_are_refused(ctx_list, error, message):
    with pytest.raises(error) as info:
        set_omp_threads(1, ctx_list)
    assert message in str(info.value)


def test_omp_threads_takes_one_cpu_context():
    with pytest.raises(ValueError, match=r"gpu\(1\) is not a CPU context"):
        omp_threads(mx.gpu(1))
    with pytest.raises(TypeError, match="ctx must be an mxnet Context"):
        omp_threads([mx.cpu(0)])


def test_on_worker_threads_runs_in_a_cpu_context_s_threads_only():
    results = on_worker_threads(mx.cpu(0), lambda: "ran")
    assert results and set(results) == {"ran"}   # one result a worker thread
    with pytest.raises(ValueError, match=r"gpu\(0\) is not a CPU context"):
        on_worker_threads(mx.gpu(0), lambda: "ran")
    with pytest.raises(TypeError, match="ctx must be an mxnet Context"):
        on_worker_threads("cpu", lambda: "ran")


@pytest.mark.slow
def test_sets_the_worker_threads_of_the_given_contexts_only():
    """After import: the given contexts' worker threads change, the Python thread and other contexts do not."""
    result = run_fresh("""
        import json
        import mxnet as mx
        from parallel.mxnet_compat import mxnet_library
        from parallel.threads import omp_threads, set_omp_threads

        python_thread = mxnet_library().omp_get_max_threads
        out = {"python_before": python_thread()}
        previous = set_omp_threads(1, [mx.cpu(0), mx.cpu_pinned(0), mx.gpu(0), mx.cpu(1)])
        out["previous"] = {str(c): t for c, t in previous.items()}
        out["after_1"] = [omp_threads(mx.cpu(i)) for i in range(3)] + [omp_threads(mx.cpu_pinned(0))]
        (mx.nd.ones((64, 64)) * 3).wait_to_read()   # the setting stays while operators run
        out["after_ops"] = omp_threads(mx.cpu(0))
        out["again"] = set_omp_threads(1, [mx.cpu(0)])[mx.cpu(0)]   # no change: allowed at any time
        out["python_after"] = python_thread()
        print(json.dumps(out))
        """)
    default = result["after_1"][2]   # cpu(2) was not in the list: MXNet's default
    assert default >= 1
    assert result["previous"] == {"cpu(0)": default, "cpu_pinned(0)": default, "cpu(1)": default}   # no gpu
    assert result["after_1"] == [1, 1, default, 1]
    assert result["after_ops"] == result["again"] == 1
    assert result["python_after"] == result["python_before"]        # the Python thread is not touched


@pytest.mark.slow
@pytest.mark.parametrize("before", [
    "device_params = [get_params(init_lenet_params(seed=0), mx.cpu(0))]\n"
    "X, y = mx.nd.ones((32, 1, 28, 28)), mx.nd.array(np.arange(32) % 10)\n"
    "train_batch(X, y, device_params, [mx.cpu(0)], 0.1)\n"
    "mx.nd.waitall()",
    "omp_threads(mx.cpu(0))",
], ids=["after a training step", "after omp_threads"])
def test_a_change_after_operators_ran_is_refused_and_changes_nothing(before):
    """Changing the threads of a worker thread that ran oneDNN operators aborted or hung most fresh processes
    (heap corruption): refused, with the fix, and the process goes on training normally."""
    other = 2 if CORES >= 2 and CORES // 2 != 2 else 1
    result = run_fresh(f"""
        import json
        import mxnet as mx
        import numpy as np
        from parallel import get_params, init_lenet_params, train_batch
        from parallel.threads import omp_threads, set_omp_threads

{textwrap.indent(before, " " * 8)}
        default = omp_threads(mx.cpu(0))
        try:
            set_omp_threads({other} if default != {other} else 1, [mx.cpu(0)])
            error = None
        except RuntimeError as e:
            error = str(e)
        device_params = [get_params(init_lenet_params(seed=0), mx.cpu(0))]
        for _ in range(2):
            train_batch(mx.nd.ones((32, 1, 28, 28)), mx.nd.array(np.arange(32) % 10), device_params, [mx.cpu(0)], 0.1)
        mx.nd.waitall()
        print(json.dumps({{"error": error, "default": default, "after": omp_threads(mx.cpu(0))}}))
        """)
    assert result["error"] is not None and "operators already ran on cpu(0)" in result["error"]
    assert "set OMP_NUM_THREADS before importing mxnet" in result["error"]
    assert result["after"] == result["default"]


@pytest.mark.slow
def test_mxnet_default_is_what_the_call_changes():
    """Unset, MXNet gives each worker half the cores (x86); OMP_NUM_THREADS before import gives it that."""
    unset = run_fresh("""
        import json, platform
        import mxnet as mx
        from parallel.threads import omp_threads
        print(json.dumps({"threads": omp_threads(), "machine": platform.machine()}))
        """)
    if unset["machine"] in ("x86_64", "AMD64", "i386", "i686") and CORES >= 2:
        assert unset["threads"] == CORES // 2
    env = run_fresh("""
        import json
        from parallel.threads import omp_threads
        print(json.dumps(omp_threads()))
        """, OMP_NUM_THREADS="1")
    assert env == 1


@pytest.mark.slow
def test_every_worker_thread_of_a_context_is_set():
    """MXNET_CPU_WORKER_NTHREADS=2: two worker threads run cpu(0)'s operators; both change."""
    result = run_fresh("""
        import json
        import threading
        import mxnet as mx
        from parallel.mxnet_compat import mxnet_library
        from parallel.threads import on_worker_threads, set_omp_threads

        lib = mxnet_library()
        set_omp_threads(1, [mx.cpu(0)])
        set_omp_threads(ctx_list=[mx.cpu(1)])
        ids = set(on_worker_threads(mx.cpu(0), threading.get_native_id))
        after_1 = on_worker_threads(mx.cpu(0), lambda: int(lib.omp_get_max_threads()))
        after_all = on_worker_threads(mx.cpu(1), lambda: int(lib.omp_get_max_threads()))
        print(json.dumps({"threads": len(ids), "after_1": after_1, "after_all": after_all}))
        """, MXNET_CPU_WORKER_NTHREADS="2")
    assert result == {"threads": 2, "after_1": [1, 1], "after_all": [CORES, CORES]}


@pytest.mark.slow
def test_naive_engine_sets_the_calling_thread():
    """NaiveEngine runs operators in the thread that issues them: that thread is the one set."""
    result = run_fresh("""
        import json
        import mxnet as mx
        from parallel.mxnet_compat import mxnet_library
        from parallel.threads import omp_threads, set_omp_threads
        set_omp_threads(1)
        print(json.dumps([omp_threads(), int(mxnet_library().omp_get_max_threads())]))
        """, MXNET_ENGINE_TYPE="NaiveEngine")
    assert result == [1, 1]


@pytest.mark.slow
def test_a_shared_pool_engine_is_refused_with_the_fix():
    result = run_fresh("""
        import json
        from parallel.threads import set_omp_threads
        try:
            set_omp_threads(1)
        except RuntimeError as e:
            print(json.dumps(str(e)))
        """, MXNET_ENGINE_TYPE="ThreadedEngine")
    assert "MXNET_ENGINE_TYPE=ThreadedEngine" in result and "set OMP_NUM_THREADS before importing" in result


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_the_shared_machine_advice_is_what_the_cli_does(tmp_path):
    """docs/threads.md says what to do on a busy shared machine (the CLI's every-core default made a one-context
    epoch 12x slower there, issue 38): set OMP_NUM_THREADS, and read it in the header. The CLI keeps the value set
    and its header shows it, as the page says."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = " ".join(open(os.path.join(root, "docs", "threads.md")).read().split())
    assert "## On a busy or shared machine" in text and "spins there (busy-waits)" in text
    assert "31.8 s" in text and "2.7 s" in text and "12x" in text and "(issue 38)" in text
    from conftest import easy_dataset, write_idx_files
    data_dir = write_idx_files(tmp_path, easy_dataset(num_train=64, num_test=16, seed=1))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = run_process([sys.executable, "-m", "parallel.train", "--data-dir", str(data_dir), "--devices", "cpu:1",
                          "--epochs", "1", "--batch-size", "32", "--no-progress"], timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    [header] = [line for line in result.stdout.splitlines() if line.startswith("strategy ")]
    assert header.endswith("; operator threads: OMP_NUM_THREADS=1"), header
