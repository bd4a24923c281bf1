"""Signals against a run whose step never finishes: the main thread waits inside MXNet, where no Python signal
handler runs, and the second signal must still end the process at once."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, easy_dataset, start_process, stop_process, write_idx_files

# A training run whose every step pushes an engine operator that never returns: reading the step's loss
# blocks the main thread inside MXNet (WaitToRead) for good, as a deadlocked operator would.
STUCK = """
import ctypes, sys, threading
import mxnet as mx
import parallel.train_steps as steps
from parallel.engine import ENGINE_SYNC_FUNC, push_sync
from parallel.train import main

never = threading.Event()

@ENGINE_SYNC_FUNC
def block(run_context, param):
    never.wait()

def stuck_step(X, y, lr=None, optimizer=None, accumulate=1):
    out = mx.nd.zeros((1,), ctx=mx.cpu(0))
    push_sync(block, out.context, writes=[out])
    return out, out

def stuck_strategy(*args, **kwargs):
    strategy = make_strategy(*args, **kwargs)
    strategy.train_step = stuck_step
    return strategy

make_strategy, steps.make_strategy = steps.make_strategy, stuck_strategy
sys.exit(main({argv!r}))
"""


@pytest.fixture
def data_dir(tmp_path):
    return write_idx_files(tmp_path, easy_dataset(num_train=200, num_test=50))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_a_run_stuck_inside_mxnet(sig, data_dir, tmp_path):
    argv = ["--devices", "cpu:1", "--epochs", "1", "--batch-size", "20", "--data-dir", str(data_dir),
            "--no-progress", "--metrics-json", str(tmp_path / "m.json")]
    process = start_process([sys.executable, "-c", textwrap.dedent(STUCK).format(argv=argv)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("training LeNet"), process.stderr.read()
        time.sleep(1.0)                         # the main thread is now blocked reading the first step's loss
        process.send_signal(sig)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1.5)           # the first asks for a stop at the next batch: none comes
        process.send_signal(sig)
        status = process.wait(timeout=10)       # at once: the main thread is still blocked
        err = process.stderr.read()
    finally:
        if process.poll() is None:
            stop_process(process)
    assert status == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted", err
    assert not (tmp_path / "m.json").exists()    # no epoch finished
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
