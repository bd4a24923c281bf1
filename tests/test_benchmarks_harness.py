"""benchmarks/harness.py, what the benchmark scripts share: the rounds visit every configuration, the ratios take
the right reference, the flags refuse bad values with their names, the results are written whole, a child's
RESULT line is read back and a child that hangs is stopped with its process group."""
import argparse
import contextlib
import doctest
import json
import os
import sys
import time

import pytest

from parallel.data import FILES
from conftest import load_benchmark


@pytest.fixture(scope="module")
def harness():
    return load_benchmark("harness")


def test_its_examples_run(harness):
    assert doctest.testmod(harness).failed == 0


@pytest.mark.parametrize("order", ["shuffle", "rotate", "fixed"])
def test_every_round_visits_every_configuration_once(harness, order):
    rounds = list(harness.round_orders("abcd", 5, order))
    assert len(rounds) == 5 and all(sorted(keys) == list("abcd") for keys in rounds)
    if order == "rotate":
        assert [keys[0] for keys in rounds] == list("abcda")
    if order == "fixed":
        assert rounds == [list("abcd")] * 5
    if order == "shuffle":   # seeded: the same orders every run
        assert rounds == list(harness.round_orders("abcd", 5, order)) and len(set(map(tuple, rounds))) > 1
    with pytest.raises(ValueError, match="order must be one of shuffle, rotate, fixed, got 'sorted'"):
        list(harness.round_orders("ab", 1, "sorted"))


def test_interleave_keeps_each_configurations_samples_in_order(harness, capsys):
    visits = []

    def measure(key):
        visits.append(key)
        return len(visits)
    samples = harness.interleave(measure, ["a", "b"], 3, order="fixed", progress="round")
    assert visits == ["a", "b"] * 3 and samples == {"a": [1, 3, 5], "b": [2, 4, 6]}
    assert "round 3/3 done" in capsys.readouterr().err


def test_time_interleaved_warms_up_then_times_each_function_every_round(harness):
    calls = []
    fns = {key: (lambda key=key: calls.append(key)) for key in "xyz"}
    times = harness.time_interleaved(fns, 2, calls=lambda key: 2 if key == "x" else 1, warmup=1, unit="s")
    assert {key: len(t) for key, t in times.items()} == {"x": 2, "y": 2, "z": 2}
    assert calls[:3] == list("xyz") and calls.count("x") == 1 + 2 * 2 and calls.count("y") == 1 + 2
    assert all(t >= 0 for ts in times.values() for t in ts)


def test_ratios_against_each_groups_reference(harness):
    records = [{"g": 1, "m": "a", "v": 4.0}, {"g": 1, "m": "ref", "v": 2.0}, {"g": 2, "m": "a", "v": 3.0},
               {"g": 3, "m": "ref", "v": 5.0}]
    harness.add_ratios(records, group=lambda r: r["g"], reference=lambda r: r["m"] == "ref", value="v")
    assert [r.get("ratio") for r in records] == [2.0, 1.0, None, 1.0]   # group 2 has no reference: no ratio
    harness.add_ratios(records, group=lambda r: r["g"], value="v", field="to_first")
    assert [r["to_first"] for r in records] == [1.0, 0.5, 1.0, 1.0]
    assert harness.median(iter([3, 1, 2])) == 2 and harness.medians({"a": [1, 5, 2]}) == {"a": 2}


def _parser(harness):
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--ks", action=harness.CommaList, item=int, minimum=1, default=[1, 2])
    parser.add_argument("--networks", action=harness.CommaList, names=("lenet", "resnet18"), default=["lenet"])
    return parser


@pytest.mark.parametrize("argv, message", [
    (["--ks", "1,x"], "--ks takes comma-separated integers, got '1,x'"),
    (["--ks", "0,2"], "--ks takes integers >= 1, got '0,2'"),
    (["--ks", ","], "--ks takes at least one value, got ','"),
    (["--networks", "vgg"], "--networks takes lenet and/or resnet18, got 'vgg'"),
])
def test_comma_lists_refuse_bad_values_by_the_flags_name(harness, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        _parser(harness).parse_args(argv)
    assert stopped.value.code == 2 and f"error: {message}" in capsys.readouterr().err


def test_comma_lists_parse_in_order_each_value_once(harness):
    args = _parser(harness).parse_args(["--ks", "4,2,4", "--networks", "resnet18,lenet"])
    assert args.ks == [4, 2] and args.networks == ["resnet18", "lenet"]
    assert _parser(harness).parse_args([]).ks == [1, 2]


def test_results_are_written_whole_and_checked_first(harness, tmp_path):
    path = harness.results_path(str(tmp_path / "new"), "r.json")
    assert harness.write_json(path, {"a": [1, 2]}) == path and json.loads(open(path).read()) == {"a": [1, 2]}
    assert not [name for name in os.listdir(tmp_path / "new") if name.endswith(".tmp")]
    (tmp_path / "taken").write_text("x")
    with pytest.raises((ValueError, OSError)):
        harness.results_path(str(tmp_path / "taken"), "r.json")
    fig, ax = harness.figure()
    ax.plot([1, 2], [3, 4])
    harness.save_figure(fig, str(tmp_path / "plots" / "p.png"))
    assert (tmp_path / "plots" / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_tables_and_labels(harness):
    assert harness.markdown_table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]
    assert (harness.size_label(4096), harness.size_label(64 * 1024 ** 2)) == ("4 KB", "64 MB")


def test_a_commands_status(harness, capsys):
    def refuse():
        raise ValueError("--steps must be >= 1, got 0")

    def fail(_):
        raise harness.BenchmarkError("the job failed")
    assert harness.command_status(refuse, fail) == 2 and "error: --steps must be >= 1" in capsys.readouterr().err
    assert harness.command_status(lambda: 1, fail) == 1 and "error: the job failed" in capsys.readouterr().err
    assert harness.command_status(lambda: 1, lambda checked: None) == 0
    with pytest.raises(ValueError, match="--warmup must be >= 0, got -1"):
        harness.check_minimum([("--steps", 1), ("--warmup", -1)], minimum=0)


def test_a_child_reports_one_result_line(harness):
    out, _ = harness.run_process([sys.executable, "-c", "import sys; sys.path.append(sys.argv[1]); import harness; "
                                  "print('noise'); harness.report_result({'x': 1})",
                                  os.path.dirname(harness.__file__)], timeout=60)
    assert harness.read_result("[worker 0] " + out.strip().splitlines()[-1]) == {"x": 1}
    with pytest.raises(harness.BenchmarkError, match="the child printed no RESULT line"):
        harness.read_result("noise\n", "the child")
    env = harness.child_env(DMLC_ROLE="worker", EXTRA="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == harness.ROOT and env["EXTRA"] == "1"
    assert "DMLC_ROLE" not in harness.child_env()


@pytest.mark.slow   # starts and ends child processes
def test_a_failing_or_hanging_child_is_an_error_and_leaves_nothing(harness, tmp_path):
    with pytest.raises(harness.BenchmarkError, match=r"failed \(exit 3\): boom"):
        harness.run_process([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    marker = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(harness.BenchmarkError, match="timed out after 2 s"):
        harness.run_process([sys.executable, "-c", code], timeout=2)
    assert time.monotonic() - started < 30
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and harness.proc_parent(grandchild) is not None:
        time.sleep(0.1)
    assert harness.proc_parent(grandchild) is None   # the whole group went
    assert harness.proc_parent(os.getpid()) == os.getppid() and harness.proc_environ(os.getpid())["PATH"]


_INTERRUPTED_SCRIPT = """
import os, sys, time
sys.path.append(sys.argv[1])
import harness
made, pid_file, wrapped = sys.argv[2], sys.argv[3], sys.argv[4] == "command"
sleeper = ("import os, time; open(%r, 'w').write(str(os.getpid())); time.sleep(120)" % pid_file)

def main():
    os.mkdir(made)
    try:
        harness.run_process([sys.executable, "-c", sleeper], timeout=300)
    finally:
        os.rmdir(made)

sys.exit(harness.command(main) if wrapped else main())
"""


@pytest.mark.slow   # starts and ends child processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapped", [True, False], ids=["command", "plain"])
def test_sigterm_ends_a_script_as_ctrl_c_does_only_under_command(harness, tmp_path, wrapped):
    """Under ``harness.command`` a SIGTERM stops the script's child with its group and runs its ``finally`` (status
    130, one line); a script that calls ``main()`` plainly dies at once and leaves both behind."""
    import signal
    import subprocess
    from conftest import start_process
    made, pid_file = tmp_path / "made", tmp_path / "sleeper.pid"
    script = start_process([sys.executable, "-c", _INTERRUPTED_SCRIPT, os.path.dirname(harness.__file__),
                            str(made), str(pid_file), "command" if wrapped else "plain"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and script.poll() is None, script.communicate()
        time.sleep(0.1)
    sleeper = int(pid_file.read_text())
    try:
        os.kill(script.pid, signal.SIGTERM)
        _, err = script.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while wrapped and time.monotonic() < deadline and harness.proc_parent(sleeper) is not None:
            time.sleep(0.1)
        if wrapped:
            assert script.returncode == 130 and err == "error: interrupted; the runs were stopped\n", err
            assert harness.proc_parent(sleeper) is None and not made.exists()
        else:
            assert script.returncode == -signal.SIGTERM
            assert harness.proc_parent(sleeper) is not None and made.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sleeper, signal.SIGKILL)


def test_recorded_paths_are_a_readers(harness):
    """What a result records holds no path of this machine: the repository, this Python, the siblings and the
    temporary directory are written as a reader types them; any other text is left as it is."""
    import tempfile
    root, tmp = harness.ROOT, tempfile.gettempdir()
    recorded = harness.portable({"command": f"{sys.executable} {root}/benchmarks/x.py --out {tmp}/r/m.json",
                                 "runs": [os.path.join(os.path.dirname(root), "shared", "peers"), root, 3],
                                 "ours": {"tr": ({}, ["--trace", f"{tmp}/r/t.json"])},   # settings hold tuples
                                 "note": "/elsewhere/file"})
    assert recorded == {"command": "python benchmarks/x.py --out $TMPDIR/r/m.json",
                        "runs": [os.path.join(os.pardir, "shared", "peers"), ".", 3],
                        "ours": {"tr": [{}, ["--trace", "$TMPDIR/r/t.json"]]}, "note": "/elsewhere/file"}


@pytest.mark.parametrize("name", ["compression", "faults", "healing", "horovod", "optimizer_accuracy",
                                  "python_calls", "rounding"])
@pytest.mark.parametrize("made", [False, True])
def test_a_missing_data_dir_is_one_line_naming_the_command_that_makes_it(name, made, tmp_path, capsys):
    """``python benchmarks/compression.py --data-dir digits`` on a fresh clone ended in a 16-line traceback
    (``DataError: digits: missing ...``): every benchmark that reads --data-dir refuses a missing or incomplete
    directory as it parses, in one line that names the command that makes the digits there."""
    digits = tmp_path / "digits"
    if made:   # made, but not by digits_dataset.py: three of the four files
        digits.mkdir()
        for role in ("train_images", "test_images", "test_labels"):
            (digits / FILES[role]).write_bytes(b"")
    with pytest.raises(SystemExit) as stopped:
        load_benchmark(name).main(["--data-dir", str(digits)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    what = f"has no {FILES['train_labels']}" if made else "is not a directory"
    assert err == (f"error: argument --data-dir: {digits} {what}"
                   f"{' (an MNIST-format directory)' if made else ''}; make the digits there with: "
                   f"python benchmarks/digits_dataset.py --out {digits}\n")
