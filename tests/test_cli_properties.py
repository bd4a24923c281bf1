"""Property-based tests of the CLI's argument space (Hypothesis).

The contract: for any combination of flags a user can type, ``python -m parallel.train`` either trains
(status 0, every output written) or exits with status 2 and exactly one ``error:`` line; never a traceback,
never status 1 for input the user controls. Runs on a tiny MNIST-format set so that each example that
trains takes a fraction of a second.
"""
import contextlib
import io
import json
import os
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from parallel.comm import ALGORITHMS as ALLREDUCE_NAMES
from parallel.optim import OPTIMIZERS, SCHEDULES
from parallel.strategies import STRATEGIES
from parallel.train import main
from conftest import easy_dataset, write_idx_files, run_process


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(write_idx_files(tmp_path_factory.mktemp("tiny"), easy_dataset(num_train=40, num_test=20, seed=3)))


def _flag(valid, invalid):
    """Mostly a valid value; one time in ten an invalid one (a near miss or any short text)."""
    bad = st.one_of(st.sampled_from(invalid), st.text(max_size=5))
    return st.integers(0, 9).flatmap(lambda roll: bad if roll == 0 else valid)


FLAGS = {
    "--devices": _flag(st.sampled_from(["cpu:1", "cpu:2", "cpu:3", "cpu:4", "cpu", "auto", " CPU:2 "]),
                       ["cpu:", "cpu:0", "cpu:-1", "gpu:0", "gpu", "tpu:1", "cpu:1e3"]),
    "--epochs": _flag(st.integers(1, 2).map(str), ["0", "-2", "1.5"]),
    "--batch-size": _flag(st.integers(1, 60).map(str), ["0", "-1", "1e3"]),
    "--lr": _flag(st.sampled_from(["0.1", "0.5", "1e-3", "3.4e38", "1.2e-38", "1e10"]),
                  ["0", "-1", "nan", "inf", "1e-40", "1e-300", "1e39", "fast"]),
    "--seed": _flag(st.sampled_from(["0", "42950", "4294967295"]) | st.integers(0, 2 ** 32 - 1).map(str),
                    ["-1", "4294967296", str(2 ** 40)]),
    "--strategy": _flag(st.sampled_from(list(STRATEGIES)), ["diagonal"]),
    "--stages": _flag(st.integers(1, 4).map(str), ["0", "-1", "5"]),
    "--boundaries": _flag(st.sampled_from(["2", "1,3", "1,2,3", "1"]), ["0", "4", "2,1", "2,2", "conv", "", " "]),
    "--micro-batches": _flag(st.integers(1, 8).map(str), ["0", "-1"]),
    "--allreduce": _flag(st.sampled_from(ALLREDUCE_NAMES), ["pigeon"]),
    "--dataset": _flag(st.just("fashion-mnist"), ["synthetic", "cifar"]),
    "--metrics-json": _flag(st.sampled_from(["m.json", "out/m.json"]), ["", "missing/m.json", ".", "curves.png"]),
    "--plot": _flag(st.sampled_from(["curves.png", "curves.svg", "curves.jpg", "curves.pdf"]),
                    ["curves", "", "m.json", "p.xyz", "missing/p.png"]),
    # the optimizer's flags
    "--optimizer": _flag(st.sampled_from(list(OPTIMIZERS)), ["lamb", "SGD"]),
    "--momentum": _flag(st.sampled_from(["0", "0.9", "0.5"]), ["1", "-0.1", "nan"]),
    "--wd": _flag(st.sampled_from(["0", "1e-4", "0.1"]), ["-1", "inf"]),
    "--lr-schedule": _flag(st.sampled_from(list(SCHEDULES)), ["linear"]),
    "--warmup-epochs": _flag(st.sampled_from(["0", "0.5", "1"]), ["-1", "2", "nan"]),
    "--lr-decay-epochs": _flag(st.sampled_from(["1", "1,2"]), ["0", "2,1", "x"]),
    "--lr-decay": _flag(st.sampled_from(["0.1", "0.5", "1"]), ["0", "2"]),
    "--clip-norm": _flag(st.sampled_from(["1", "0.01", "100"]), ["0", "-1"]),
    "--accumulate": _flag(st.integers(1, 4).map(str), ["0", "-1", "1000"]),
    "--zero": _flag(st.sampled_from(["0", "1", "2"]), ["3", "-1"]),
}

#: Flags without a value.
SWITCHES = ("--nesterov",)


LAYOUT_FLAGS = ("--strategy", "--stages", "--boundaries", "--micro-batches")


@st.composite
def command_lines(draw):
    """Up to six general flags, then a strategy with the layout flags that fit it (one time in ten, one
    that does not)."""
    general = sorted(set(FLAGS) - set(LAYOUT_FLAGS)) + list(SWITCHES)
    chosen = draw(st.lists(st.sampled_from(general), unique=True, max_size=6))
    argv = []
    for flag in chosen:
        argv += [flag] if flag in SWITCHES else [flag, draw(FLAGS[flag])]
    strategy = draw(st.sampled_from([None, *STRATEGIES]))
    if strategy is None:
        return argv
    argv += ["--strategy", strategy]
    fitting = [] if strategy == "data" else [None, "--stages", "--boundaries"]
    layout = draw(st.sampled_from(fitting or [None])) if draw(st.integers(0, 9)) else \
        draw(st.sampled_from(["--stages", "--boundaries", "--micro-batches"]))
    if layout:
        argv += [layout, draw(FLAGS[layout])]
    if strategy == "pipeline" and draw(st.booleans()):
        argv += ["--micro-batches", draw(FLAGS["--micro-batches"])]
    return argv


def _run(argv, cwd):
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
    finally:
        os.chdir(old)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.property
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(argv=command_lines())
def test_any_flags_train_or_exit_2_with_one_error_line(tiny_dir, argv):
    """main() never raises for user input: it trains (0) or prints one ``error:`` line and returns 2."""
    argv = argv + ["--data-dir", tiny_dir, "--no-progress"]
    with tempfile.TemporaryDirectory() as cwd:
        os.mkdir(os.path.join(cwd, "out"))
        status, out, err = _run(argv, cwd)
        errors = [line for line in err.splitlines() if not line.startswith("warning: ")]
        assert status in (0, 2), (argv, status, err)
        if status == 2:
            assert len(errors) == 1 and errors[0].startswith("error: "), (argv, err)
            return
        assert errors == [], (argv, err)
        epochs = int(argv[argv.index("--epochs") + 1]) if "--epochs" in argv else 10
        assert out.count("\nepoch ") + out.startswith("epoch ") == epochs, out
        if "--metrics-json" in argv:
            path = os.path.join(cwd, argv[argv.index("--metrics-json") + 1])
            assert [m["epoch"] for m in json.load(open(path))] == list(range(1, epochs + 1))
        if "--plot" in argv:
            assert os.path.getsize(os.path.join(cwd, argv[argv.index("--plot") + 1])) > 0


@pytest.mark.slow
# each example is a process (~2 s): a twentieth of the profile's examples, at least 2
@settings(max_examples=max(2, settings.default.max_examples // 20), suppress_health_check=[HealthCheck.too_slow])
@given(argv=command_lines())
def test_any_flags_in_a_real_process_never_show_a_traceback(tiny_dir, argv):
    """The same contract as a user sees it: a separate process, its exit status and stderr."""
    argv = argv + ["--data-dir", tiny_dir, "--no-progress", "--epochs", "1"]
    with tempfile.TemporaryDirectory() as cwd:
        result = run_process([sys.executable, "-m", "parallel.train", *argv], cwd=cwd, timeout=300)
    assert "Traceback" not in result.stderr, (argv, result.stderr)
    assert result.returncode in (0, 2), (argv, result.returncode, result.stderr)
    errors = [line for line in result.stderr.splitlines() if not line.startswith("warning: ")]
    assert errors == [] if result.returncode == 0 else (len(errors) == 1 and errors[0].startswith("error: "))
