"""The flight recorder (parallel.flight): what it proves and what it does not, the records a job's collectives leave
(in threads), the launcher ending a job whose workers disagree (real processes, slow tier), and ``Join`` training
uneven inputs as one process would."""
import io
import sys
import threading
import time

import mxnet as mx
import numpy as np
import pytest

from parallel import Join, Reducer, get_params, init_lenet_params, train_batch
from parallel.flight import MARKER, FlightRecorder, diagnose, parse_line
from parallel.job import allreduce_across
from conftest import in_threads, job_processes, run_process


def _recorders(*programs):
    """One recorder per program: a list of steps, each a list of (kind, key, bytes); "finish" ends the program."""
    recorders = []
    for rank, program in enumerate(programs):
        r = FlightRecorder(rank)
        for step in program:
            if step == "finish":
                r.finish()
                continue
            r.next_step()
            for kind, key, nbytes in step:
                r.record(kind, key, nbytes)
        recorders.append(r)
    return recorders


STEP = [("allreduce", 1000000, 4096), ("allreduce", 1001024, 800)]


def test_a_worker_finished_before_its_peers_last_collective_is_a_divergence():
    a, b = _recorders([STEP] * 3, [STEP] * 2 + ["finish"])
    line = diagnose([a.snapshot(8), b.snapshot(8)])
    assert line == ("rank 0 waits in allreduce #6 (step 3, key 1001024, 800 B); rank 1 finished after #4 (step 2)")


@pytest.mark.parametrize("case", ["lagging", "healthy end", "not started"])
def test_records_that_only_lag_prove_nothing(case):
    """A worker on its way to the collective its peer issued (a slow step, a checkpoint write) is not a
    divergence, however long it takes; nor is a job whose workers finished after the same collective."""
    programs = {"lagging": ([STEP] * 3, [STEP] * 2), "healthy end": ([STEP] * 3 + ["finish"], [STEP] * 3 + ["finish"]),
                "not started": ([STEP], [])}[case]
    assert diagnose([r.snapshot(8) for r in _recorders(*programs)]) is None


@pytest.mark.parametrize("other, says", [(("allreduce", 1002048, 4096), "key 1002048"),
                                         (("allreduce", 1000000, 2048), "2.0 KiB"),
                                         (("broadcast", 1000000, 4096), "broadcast #3")])
def test_another_key_size_or_kind_at_the_same_collective_is_a_divergence(other, says):
    a, b = _recorders([STEP, STEP], [STEP, [other, STEP[1]]])
    line = diagnose([a.snapshot(8), b.snapshot(8)])
    assert line.startswith("rank 0 issued allreduce #3 (step 2, key 1000000, 4.0 KiB) where rank 1 issued ")
    assert says in line and line.endswith("the workers' collectives differ")


def test_the_ring_buffer_keeps_the_last_records():
    r = FlightRecorder(0, size=4)
    r.next_step()
    for key in range(10):
        r.record("allreduce", key, 4)
    assert [record["seq"] for record in r.snapshot()["records"]] == [7, 8, 9, 10]
    assert [record["key"] for record in r.snapshot(2)["records"]] == [8, 9]


def test_a_published_record_is_one_line_the_launcher_reads_back():
    out = io.StringIO()
    r = FlightRecorder(1)
    r.next_step()
    r.record("allreduce", 7, 16)
    r.publish_to(out)
    r.finish()   # published at once, with the main thread's stack
    lines = [line for line in out.getvalue().splitlines() if MARKER in line]
    assert lines, out.getvalue()
    text, snapshot = parse_line("12%|##" + lines[-1])
    assert text == "12%|##"
    assert snapshot["rank"] == 1 and snapshot["finished"] and snapshot["records"][0]["key"] == 7
    assert any("test_flight.py" in line for line in snapshot["stack"])
    assert parse_line("epoch 1, loss 2.3") == ("epoch 1, loss 2.3", None)


def _lenet_worker(steps_of_rank):
    """A worker of a threaded job: LeNet on one context, ``steps_of_rank[rank]`` steps of a global batch of 8."""
    def work(job, rank):
        ctx_list = [mx.cpu(rank)]
        device_params = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
        reducer = Reducer(job=job)
        X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.zeros((8,))
        for _ in range(steps_of_rank[rank]):
            train_batch(X, y, device_params, ctx_list, lr=0.1, reducer=reducer).wait_to_read()
            device_params[0].data.wait_to_read()
        job.flight.finish()
    return work


def test_a_job_one_step_short_leaves_records_that_name_the_divergence(threads_reduce_at_once):
    """The records the package's own collectives leave (Job.allsum numbered, optimizer_step counting the steps),
    in a job of two threads where rank 1 takes one step fewer: rank 0 blocks in its last step's collective, and the
    records say so."""
    jobs, errors = {}, []
    work = _lenet_worker({0: 3, 1: 2})

    def recording(job, rank):
        jobs[rank] = job
        work(job, rank)
    thread = threading.Thread(target=lambda: errors.append(_run_quietly(recording)), daemon=True)
    thread.start()
    deadline, line = time.monotonic() + 60, None
    while line is None and time.monotonic() < deadline:
        time.sleep(0.05)
        if len(jobs) == 2:
            line = diagnose([job.flight.snapshot(8) for job in jobs.values()])
    servers = jobs[0].kv if 0 in jobs else None
    if servers is not None:   # release rank 0 from its barrier
        servers.servers.abort()
    thread.join(30)
    assert line is not None, [job.flight.snapshot(8) for job in jobs.values()]
    assert line.startswith("rank 0 waits in allreduce #") and "(step 3, key 1000000" in line
    assert line.endswith("rank 1 finished after #" + str(jobs[1].flight.seq) + " (step 2)")


def _run_quietly(work):
    try:
        in_threads(2, work)
    except BaseException as error:   # the aborted barrier: expected
        return error


def test_join_trains_uneven_inputs_as_one_process_would(threads_reduce_at_once):
    """Rank 1 has one batch fewer: with Join both finish every step, their replicas equal, bitwise the model one
    process trains on the same batches (two contexts for the steps both workers have a batch, one context for
    the last: a zero gradient added is exact)."""
    rng = np.random.default_rng(0)
    batches = [(mx.nd.array(rng.normal(size=(6, 1, 28, 28))), mx.nd.array(rng.integers(0, 10, size=6)))
               for _ in range(5)]
    mine = {0: [batches[0], batches[2], batches[4]], 1: [batches[1], batches[3]]}

    def work(job, rank):
        ctx_list = [mx.cpu(rank)]
        device_params = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
        with Join(device_params, ctx_list, Reducer(job=job), lr=0.1) as join:
            for X, y in mine[rank]:
                join.train_batch(X, y)
        return device_params[0].data.asnumpy(), join.steps, join.idle_steps

    results, _ = in_threads(2, work)
    assert [r[1:] for r in results] == [(3, 0), (2, 1)]
    ctx_list = [mx.cpu(0), mx.cpu(1)]
    reference = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
    for (X0, y0), (X1, y1) in [(batches[0], batches[1]), (batches[2], batches[3])]:
        train_batch(mx.nd.concat(X0, X1, dim=0), mx.nd.concat(y0, y1, dim=0), reference, ctx_list, lr=0.1)
    X, y = batches[4]
    train_batch(X, y, reference[:1], ctx_list[:1], lr=0.1)
    want = reference[0].data.asnumpy()
    np.testing.assert_array_equal(results[0][0], want)
    np.testing.assert_array_equal(results[1][0], want)


def test_join_in_one_process_is_the_plain_step():
    ctx_list = [mx.cpu(0)]
    got = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
    want = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
    X, y = mx.nd.ones((4, 1, 28, 28)), mx.nd.array([0, 1, 2, 3])
    with Join(got, ctx_list, Reducer(), lr=0.1) as join:
        join.train_batch(X, y)
    train_batch(X, y, want, ctx_list, lr=0.1)
    np.testing.assert_array_equal(got[0].data.asnumpy(), want[0].data.asnumpy())
    assert (join.steps, join.idle_steps) == (1, 0)
