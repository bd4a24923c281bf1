"""Training across processes: W workers x K contexts, launched by parallel.launch, train the same model as one
context (rtol 1e-5 of each array's scale), for batch sizes that leave some workers without an example."""
import os
import re
import sys

import numpy as np
import pytest

from parallel import get_params, init_lenet_params, train_batch
from parallel.job import worker_slice
from conftest import assert_same_parameters, contexts, make_batches, run_process

SIZES = [13, 7, 3, 12, 1, 5]   # 3 and 1 leave workers with empty slices when W x K > 3

WORKER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from conftest import make_batches
from parallel import Reducer, get_params, init_lenet_params, train_batch
from parallel.job import broadcast_params, join
import mxnet as mx

job = join()
k = {k}
ctx_list = [mx.cpu(i) for i in range(k)]
seed = 100 + job.rank   # every rank starts elsewhere: rank 0's parameters must win
device_params = [get_params(init_lenet_params(seed=0 if job.rank == 0 else seed, dtype="float64"), c)
                 for c in ctx_list]
broadcast_params(job, device_params)
for step, (X, y) in enumerate(make_batches({sizes!r}, seed=3, dtype="float64")):
    train_batch(X, y, device_params, ctx_list, lr=0.2, reducer=Reducer(job=job)).wait_to_read()
    print("step", step, flush=True)   # progress the launcher's --stall-timeout watches
for replica in device_params[1:]:
    for a, b in zip(replica, device_params[0]):
        assert (a.asnumpy() == b.asnumpy()).all(), "replicas differ within a worker"
np.savez({out!r} + f"-{{job.rank}}.npz", *[p.asnumpy() for p in device_params[0]])
print("done", job.rank)
"""


def test_worker_slices_cover_the_batch_in_order():
    for n in range(0, 20):
        for k in (1, 2, 3):
            for w in (1, 2, 3):
                slices = [worker_slice(n, k, rank, w) for rank in range(w)]
                assert slices[0][0] == 0 and slices[-1][1] == n
                assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))


@pytest.mark.slow
def test_the_textbook_loop_across_processes_trains_the_same_model_as_one_context(tmp_path):
    """The API's textbook loop (train_batch with job=) under the launcher, 3 workers x 2 contexts on batches
    that leave some workers without an example, in float64. The whole W x K matrix, through the CLI, is
    tests/test_train_distributed.py's."""
    workers, k, servers = 3, 2, 2
    out = str(tmp_path / "params")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=os.path.dirname(os.path.abspath(__file__)), k=k, sizes=SIZES, out=out))
    result = run_process([sys.executable, "-m", "parallel.launch", "-n", str(workers), "-s", str(servers),
                          "--stall-timeout", "60",   # a deadlocked step ends the job, not the test run
                          "--env", "MXNET_KVSTORE_BIGARRAY_BOUND:1000",   # split the buffer over servers
                          sys.executable, str(script)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ctx_list = contexts(1)
    want = [get_params(init_lenet_params(seed=0, dtype="float64"), ctx_list[0])]
    for X, y in make_batches(SIZES, seed=3, dtype="float64"):
        train_batch(X, y, want, ctx_list, lr=0.2)
    for rank in range(workers):
        with np.load(f"{out}-{rank}.npz") as got:
            assert_same_parameters([got[f"arr_{i}"] for i in range(8)], [p.asnumpy() for p in want[0]], "float64")


P3_WORKER = """
import sys
import mxnet as mx
import numpy as np
from parallel.job import KEYS, join

job = join()
job.p3 = sys.argv[1] == "numbered"   # "as-is": the package's own keys handed to P3
rng = np.random.RandomState(0)   # every worker draws the same numbers; worker r sends them times r + 1
bad = 0
for step in range(2):   # a sum of 1 number (key 101), then a big key 0: 300 slices, server keys 0 .. 150 each
    for key, n in [(KEYS["sums"] + 1, 1), (KEYS["params"], 30000), (KEYS["sums"] + 3, 3)]:
        mine = rng.rand(n).astype("float32")
        got = job.allsum(key, mx.nd.array(mine * (job.rank + 1))).asnumpy()
        bad += not np.array_equal(got, mine * 1 + mine * 2)
print("wrong sums", bad, flush=True)
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("keys", ["numbered", "as-is"])
def test_under_p3_no_two_keys_share_a_server_key(keys, tmp_path):
    """MXNet's P3 store numbers a slice's server key ``key + n / servers`` (``n``: every slice the process made
    so far): handed as they are, key 101 (one number, first) and key 0 (300 slices, later) meet on a server key,
    which adds a slice of one to a number of the other or ends the server ("operands shape mismatch"); numbered
    0, 1, 2 in the order of first use (``Job.p3``), every sum is right."""
    script = tmp_path / "p3.py"
    script.write_text(P3_WORKER)
    result = run_process([sys.executable, "-m", "parallel.launch", "-n", "2", "--stall-timeout", "60",
                          "--env", "DMLC_PS_VAN_TYPE:p3", "--env", "MXNET_KVSTORE_SLICE_THRESHOLD:100",
                          sys.executable, str(script), keys], timeout=300)
    if keys == "numbered":
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("wrong sums 0") == 2, result.stdout
    else:
        assert result.returncode != 0 and ("operands shape mismatch" in result.stderr or
                                           "wrong sums" in result.stdout), result.stdout + result.stderr[-3000:]


P3_ROUNDS_WORKER = """
import sys
import mxnet as mx
from parallel.job import join

job = join()
x = mx.nd.ones((4200,))
for _ in range(int(sys.argv[1])):   # small sums back to back: the servers answer within microseconds
    x[:] = x * 0.5 + 1
    job.allsum(10, x)   # 2 workers: x + 2, exactly, in float32
print("last sum", int(x[0].asscalar()), int(x[-1].asscalar()), flush=True)
"""


def test_under_p3_thousands_of_small_sums_neither_crash_nor_go_wrong(tmp_path):
    """MXNet 1.9.1's P3 push reads memory the engine may have freed once the servers have answered (``Job.pushpull``):
    as a push and a pull, one key of 4,200 floats summed 3,000 times crashed a worker in each of 5 runs; as one
    ``pushpull`` a sum, every run ends with every sum right."""
    script = tmp_path / "rounds.py"
    script.write_text(P3_ROUNDS_WORKER)
    result = run_process([sys.executable, "-m", "parallel.launch", "-n", "2", "--van", "p3", "--stall-timeout", "60",
                          sys.executable, str(script), "3000"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("last sum 6001 6001") == 2, result.stdout


ROUNDS_ORDER_WORKER = """
import sys
import threading
import mxnet as mx
from parallel.engine import ENGINE_SYNC_FUNC, push_sync
from parallel.job import join

job = join()
job.allsum(10, mx.nd.zeros((4,))).wait_to_read()   # the key's first sum: a push and a pull; then pushpulls
if job.rank == 0:   # a round of ones, and once it is summed a round of twos
    first = job.allsum(10, mx.nd.ones((4,))).asnumpy()
    second = job.allsum(10, mx.nd.full((4,), 2.0)).asnumpy()
else:   # a round of tens that waits in the engine behind a gate, then a round of zeros ready at once
    gate = threading.Event()
    wait = ENGINE_SYNC_FUNC(lambda run_context, param: gate.wait())
    shut = mx.nd.zeros((1,), ctx=mx.cpu(1))
    push_sync(wait, mx.cpu(1), writes=[shut])   # cpu(1)'s engine thread waits for the gate
    first = job.allsum(10, mx.nd.full((4,), 10.0) + shut.as_in_context(mx.cpu(0)))
    zeros = mx.nd.zeros((4,))
    ordered = sys.argv[1] == "ordered"
    if ordered:
        job.after_last_round(10, zeros)
    second = job.allsum(10, zeros)
    if not ordered:   # the zeros are summed while the tens still wait behind the gate
        second.wait_to_read()
    gate.set()
    first, second = first.asnumpy(), second.asnumpy()
print("rank", job.rank, "sums", first[0], second[0], flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["ordered", "unordered"])
def test_a_round_of_zeros_leaves_after_the_round_before_it(order, tmp_path):
    """A worker's second round of a key, on zeros ready at once, while its first still waits for its array in the
    engine: MXNet's kvstore sends the zeros first and the servers sum them with the other worker's first round
    (where it must be false: rank 0's first sum is 1 + 0); after ``Job.after_last_round`` the rounds leave in
    order and every sum is right (a BatchNorm without an example did this, and a job hung: ``idle``)."""
    script = tmp_path / "order.py"
    script.write_text(ROUNDS_ORDER_WORKER)
    result = run_process([sys.executable, "-m", "parallel.launch", "-n", "2", "--stall-timeout", "60",
                          sys.executable, str(script), order], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sums = sorted(re.findall(r"rank \d sums \S+ \S+", result.stdout))
    if order == "ordered":   # 1 + 10, then 2 + 0
        assert sums == ["rank 0 sums 11.0 2.0", "rank 1 sums 11.0 2.0"], result.stdout
    else:   # the zeros with the ones, the tens with the twos
        assert sums == ["rank 0 sums 1.0 12.0", "rank 1 sums 12.0 1.0"], result.stdout


@pytest.mark.parametrize("pushpull", [True, False], ids=["pushpull", "push-then-pull"])
def test_a_sum_is_the_same_as_one_pushpull_or_as_a_push_and_a_pull(pushpull, monkeypatch):
    """``Job.pushpull`` (default on; ``PARALLEL_PUSHPULL=0`` turns it off) changes how a sum travels, not what it is:
    with either, every worker gets the servers' sum of every worker's array."""
    import mxnet as mx
    from conftest import in_threads
    monkeypatch.setenv("PARALLEL_PUSHPULL", "1" if pushpull else "0")

    def work(job, rank):   # a key's first sum is a push and a pull either way, its later ones a pushpull or not
        assert job.pushpull is pushpull
        return [job.allsum(7, mx.nd.array([rank + 1.0, 10.0 * rank])).asnumpy().tolist() for _ in range(2)]
    results, servers = in_threads(3, work)
    assert results == [[[6.0, 30.0]] * 2] * 3 and [key for key, _ in servers.pushed] == [7] * 6
