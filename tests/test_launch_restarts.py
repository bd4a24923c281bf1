"""python -m parallel.launch that heals: --max-restarts, -n MIN:MAX with a host discovery script, and a watchdog
that ends the job when the launcher itself is killed. The kvstore jobs here are tiny scripts; the training
jobs that restart are in test_train_healing.py.

The restart policy (``parallel.launch.restarts.decide``, a pure function) is tested first, every branch, and
then the launcher's loop with fake jobs (no process started), both in the fast tier: a launcher that never
restarts, or restarts what it must not, fails there.
"""
import argparse
import signal
import subprocess
import sys

import pytest

import parallel.launch.cli as launch_cli
from parallel.handover import fetch_state
from parallel.launch.restarts import (BAD_DISCOVERY, HOSTS_CHANGED, INTERRUPTED, NOT_STARTED, PROCESS_FAILED,
                                      STALL_TIMEOUT, START_TIMEOUT, SUCCESS, TOO_FEW_HOSTS, Decision, Ending, Failure,
                                      decide)
from conftest import start_process, stop_process
from test_launch import assert_nothing_left, dmlc_processes, error_lines, launcher, mark, run_launcher, \
    wait_for_pids, write_script, LOOPING_SCRIPT  # noqa: F401 (mark is a fixture)

KILLED = Ending(PROCESS_FAILED, "worker 1 (pid 7) was killed by SIGKILL; it printed nothing", returncode=-9)


@pytest.mark.parametrize("ending", [
    KILLED,
    Ending(PROCESS_FAILED, "worker 0 (pid 7) exited with status 3; its last output: bye", returncode=3),
    Ending(PROCESS_FAILED, "server 0 (pid 7) exited with status 1; it printed nothing", returncode=1),
    Ending(START_TIMEOUT, "the job did not start within 60 s (--start-timeout): ..."),
    Ending(STALL_TIMEOUT, "no worker printed a line for 2 s (--stall-timeout); ..."),
], ids=["killed", "status 3", "server status 1", "start timeout", "stall timeout"])
def test_a_failure_is_restarted_while_under_the_limit_and_stops_with_1_at_it(ending):
    assert decide(ending, 0, 2) == Decision(True, None, f"restart 1 of 2: {ending.message}")
    assert decide(ending, 1, 2) == Decision(True, None, f"restart 2 of 2: {ending.message}")
    assert decide(ending, 2, 2) == Decision(False, 1, f"error: {ending.message}")
    assert decide(ending, 0, 0) == Decision(False, 1, f"error: {ending.message}")   # the default: no restarts


def test_the_restart_line_names_the_next_starts_workers():
    assert decide(KILLED, 0, 3).restart_line(2) == ("restart 1 of 3: worker 1 (pid 7) was killed by SIGKILL; it "
                                                    "printed nothing; starting 2 worker(s) again")


def test_exit_status_2_is_never_restarted_and_passed_on():
    """Bad input fails the same way again, whichever process exited with it and however many restarts are left;
    the launcher exits with 2 too, so that its caller can tell bad input from a crash (exit 1)."""
    bad = Ending(PROCESS_FAILED, "worker 0 (pid 7) exited with status 2; its last output: error: --lr ...", 2)
    assert decide(bad, 0, 5) == Decision(False, 2, f"error: {bad.message}")
    crashed = Ending(PROCESS_FAILED, "worker 0 (pid 7) exited with status 3; it printed nothing", 3)
    assert decide(crashed, 5, 5) == Decision(False, 1, f"error: {crashed.message}")


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_launcher_stops_with_128_plus_the_signal(sig, status):
    ending = Ending(INTERRUPTED, f"interrupted by {sig.name}; stopped the 4 processes of the job", signum=sig)
    assert decide(ending, 0, 3, interrupted=True) == Decision(False, status, f"error: {ending.message}")


@pytest.mark.parametrize("ending", [KILLED, Ending(START_TIMEOUT, "did not start"), Ending(STALL_TIMEOUT, "stall")],
                         ids=["killed", "start timeout", "stall timeout"])
def test_nothing_is_restarted_once_the_launcher_was_interrupted(ending):
    """A signal that arrived while the job failed (or while it was stopped) ends the launcher with the failure."""
    assert decide(ending, 0, 3, interrupted=True) == Decision(False, 1, f"error: {ending.message}")


@pytest.mark.parametrize("ending", [
    Ending(NOT_STARTED, "worker 0 could not start: No such file or directory: 'no-such-command'"),
    Ending(TOO_FEW_HOSTS, "only 1 host(s) available, -n asks for at least 2 (waited 60 s, --start-timeout)"),
], ids=["not started", "too few hosts"])
def test_what_a_restart_cannot_mend_stops_with_1(ending):
    assert decide(ending, 0, 3) == Decision(False, 1, f"error: {ending.message}")


@pytest.mark.parametrize("message", [
    "--host-discovery-script printed a bad line 1: 'a b' is not host or host:port ...",
    "--host-discovery-script named the host 'node7', but --launcher local runs every process on this machine; ...",
], ids=["bad line", "another host"])
def test_a_bad_discovery_is_input_that_cannot_work_status_2(message):
    assert decide(Ending(BAD_DISCOVERY, message), 0, 3) == Decision(False, 2, f"error: {message}")


def test_a_discovered_host_that_is_not_this_machine_with_launcher_local_exits_2(monkeypatch, capsys):
    """It exited with 1, as if the job had failed: the script's hosts and --launcher local cannot work together."""
    status, starts = _main_with([], monkeypatch, "-n", 1, "--host-discovery-script", "echo node7.invalid",
                                "--max-restarts", 2)
    err = capsys.readouterr().err
    assert (status, starts) == (2, []) and err.count("\n") == 1, err
    assert err.startswith("error: --host-discovery-script named the host 'node7.invalid', but --launcher local"), err


@pytest.mark.parametrize("restarts, interrupted", [(0, False), (3, False), (1, True)])
def test_success_stops_with_0_and_no_line(restarts, interrupted):
    assert decide(Ending(SUCCESS), restarts, 3, interrupted) == Decision(False, 0, None)


def test_an_unknown_ending_is_a_bug():
    with pytest.raises(ValueError, match="ending.kind must be one of"):
        decide(Ending("crashed", "?"), 0, 3)


def _main_with(endings, monkeypatch, *flags, states=()):
    """``main`` with fake jobs (no process started) whose starts end as ``endings`` says, in turn; returns the
    exit status and each start's restart number. In an elastic job, a start that ends badly hands over the next
    of ``states`` (``(step, bytes)`` or None), and ``handed`` records what each start was pointed at."""
    starts, states = [], list(states)

    class FakeJob:
        def __init__(self, start, signals, watchdog):
            starts.append(start)
            handed.append(None if start.state_address is None else
                          fetch_state(*start.state_address.rsplit(":", 1)))

        def hand_over(self):
            return states.pop(0)

        def run(self):
            ending = endings[len(starts) - 1]
            if ending.kind == SUCCESS:
                return ending
            raise Failure(*ending)

        def stop(self):
            pass

        def kill_now(self):
            pass

    class FakeWatchdog:
        def close(self):
            pass

    handed = []
    monkeypatch.setattr(launch_cli, "Job", FakeJob)
    monkeypatch.setattr(launch_cli, "Watchdog", FakeWatchdog)
    status = launch_cli.main([*map(str, flags), "python", "x.py"])
    _main_with.handed = handed
    return status, [start.restart for start in starts]


def test_a_change_of_hosts_starts_again_from_the_state_taken_and_is_not_a_restart(monkeypatch, capsys):
    """The elastic loop: a change of hosts starts the job again without counting a restart (none allowed here);
    each start after one is pointed at the state taken from the start before, kept when a start gives none."""
    changed = Ending(HOSTS_CHANGED, "the job's hosts changed: 127.0.0.1 joined (2 listed, -n 1:2)")
    status, starts = _main_with([changed, changed, Ending(SUCCESS)], monkeypatch, "-n", "1:2",
                                states=[(7, b"seven"), None])
    assert (status, starts) == (0, [0, 1, 2])
    assert _main_with.handed == [None, (7, b"seven"), (7, b"seven")]
    assert capsys.readouterr().err.splitlines() == [f"{changed.message}; starting 2 worker(s) again"] * 2


def test_the_reset_limit_ends_a_job_whose_hosts_keep_changing(monkeypatch, capsys):
    changed = Ending(HOSTS_CHANGED, "the job's hosts changed: 127.0.0.1 left (1 listed, -n 1:2)")
    status, starts = _main_with([changed] * 3, monkeypatch, "-n", "1:2", "--reset-limit", 2, states=[None] * 3)
    assert (status, starts) == (1, [0, 1, 2])
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == f"error: {changed.message}; the job has changed hosts 2 times, --reset-limit 2", lines
    assert len(lines) == 3


def test_a_host_that_fails_twice_is_left_out_for_a_cooldown(monkeypatch, capsys):
    """Each failure on host h2 counts (on this machine none does); the second leaves h2 out, in one line."""
    on_h2 = Ending(PROCESS_FAILED, "worker 1 (pid 7, ssh to h2) was killed by SIGKILL; it printed nothing", -9,
                   host="h2")
    local = Ending(PROCESS_FAILED, "worker 1 (pid 7) was killed by SIGKILL; it printed nothing", -9)
    status, _ = _main_with([on_h2, local, on_h2, Ending(SUCCESS)], monkeypatch, "-n", 2, "--max-restarts", 3)
    assert status == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[2] == "host h2 failed 2 times: left out of the job for 60 s (--host-cooldown)", lines
    assert len(lines) == 4


def test_a_failure_that_leaves_too_few_hosts_is_still_said_before_the_job_ends(monkeypatch, capsys):
    """The second failure on h2, the only host, leaves it out: the line that says what ended that start comes
    before the one that ends the job (no start of 0 workers is announced)."""
    on_h2 = Ending(PROCESS_FAILED, "worker 0 (pid 7, ssh to h2) exited with status 1", 1, host="h2")
    status, starts = _main_with([on_h2, on_h2], monkeypatch, "--launcher", "ssh", "--scheduler-host", "10.0.0.1",
                                "-n", "1:1", "--host-discovery-script", "echo h2", "--start-timeout", "0.1",
                                "--max-restarts", 5, states=[None, None])
    assert (status, starts) == (1, [0, 1])
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("no worker's state")]
    assert lines == [f"restart 1 of 5: {on_h2.message}; starting 1 worker(s) again",
                     "host h2 failed 2 times: left out of the job for 60 s (--host-cooldown)",
                     f"restart 2 of 5: {on_h2.message}; too few hosts to start again",
                     "error: only 0 host(s) available, 1 left out after failing (h2: --host-cooldown), -n asks for at "
                     "least 1 (waited 0.1 s, --start-timeout)"]


def test_a_host_left_out_is_not_planned_and_too_few_hosts_say_why(tmp_path):
    from parallel.launch.cli import build_parser, check_args
    from parallel.launch.job import Signals, plan_start
    args = build_parser().parse_args(["--launcher", "ssh", "--scheduler-host", "10.0.0.1", "-n", "1:2",
                                      "--host-discovery-script", "echo h1; echo h2", "--start-timeout", "0.1",
                                      "python", "x.py"])
    check_args(args)
    assert plan_start(args, 0, Signals()).hosts == [("h1", None), ("h2", None)]
    args.cooldowns.failed("h2")
    args.cooldowns.failed("h2")
    assert plan_start(args, 1, Signals()).hosts == [("h1", None)]
    args.min_workers = 2
    with pytest.raises(Failure, match=r"only 1 host\(s\) available, 1 left out after failing \(h2: "
                                      r"--host-cooldown\), -n asks for at least 2"):
        plan_start(args, 2, Signals())


@pytest.mark.parametrize("now, changed", [
    (["h1", "h2"], None),                    # the file as the start found it
    (["h2", "h1", "h2"], None),              # h2 twice: a slot the job has no room for (-n 1:2, 2 running)
    (["h1", "h3"], "h3 joined and h2 left"),  # one of the start's hosts replaced
    (["h1", "h2", "h9"], None),              # added, but the job runs its maximum already
])
def test_an_elastic_job_on_a_hostfile_restarts_when_the_file_changes_what_it_can_use(now, changed, tmp_path):
    """-H with -n MIN:MAX: the hostfile is read at every --discovery-interval; a change the job can use (a host
    removed that it runs on, or one added while it has room) ends the start; anything else leaves it running."""
    from parallel.launch.cli import build_parser, check_args
    from parallel.launch.job import Job, Signals, plan_start
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\n")
    args = build_parser().parse_args(["--launcher", "ssh", "--scheduler-host", "10.0.0.1", "-n", "1:2",
                                      "-H", str(hostfile), "python", "x.py"])
    check_args(args)
    start = argparse.Namespace(**{**vars(args), "hosts": [("h1", None), ("h2", None)], "restart": 0})
    job = Job(start, Signals(), None)
    job.file_at_start = [("h1", None), ("h2", None)]
    job.listed = [(host, None) for host in now]
    if changed is None:
        job.check_hosts()
    else:
        with pytest.raises(Failure, match=f"the job's hosts changed: {changed}"):
            job.check_hosts()
    start.hosts = [("h1", None)]   # room for one more: a host added joins
    job.listed = [("h1", None), ("h2", None), ("h3", None)]
    with pytest.raises(Failure, match="the job's hosts changed: h3 joined"):
        job.check_hosts()
    assert job.grown


def test_an_env_name_that_is_not_set_here_is_said_once(monkeypatch, capsys):
    """--env NAME passes NAME's value from here: one unset passed nothing and said nothing. NAME:VALUE and a NAME
    that is set pass as they are, with no line."""
    monkeypatch.delenv("NOPE_NOT_SET", raising=False)
    monkeypatch.setenv("SET_HERE", "1")
    status, _ = _main_with([Ending(SUCCESS)], monkeypatch, "-n", 1, "--env", "NOPE_NOT_SET", "--env", "SET_HERE",
                           "--env", "GIVEN:2")
    assert status == 0
    assert capsys.readouterr().err.splitlines() == [
        "warning: --env NOPE_NOT_SET: NOPE_NOT_SET is not set here, so nothing is passed; give NOPE_NOT_SET:VALUE to "
        "set it"]


def test_a_job_that_is_not_elastic_takes_no_state(monkeypatch, capsys):
    status, starts = _main_with([KILLED, Ending(SUCCESS)], monkeypatch, "-n", 2, "--max-restarts", 1,
                                states=[(3, b"never taken")])
    assert (status, starts, _main_with.handed) == (0, [0, 1], [None, None])


def test_the_launcher_restarts_a_failed_start_as_the_policy_says(monkeypatch, capsys):
    status, starts = _main_with([KILLED, Ending(SUCCESS)], monkeypatch, "-n", 2, "--max-restarts", 2)
    assert (status, starts) == (0, [0, 1])
    assert capsys.readouterr().err.splitlines() == [
        "restart 1 of 2: worker 1 (pid 7) was killed by SIGKILL; it printed nothing; starting 2 worker(s) again"]


def test_the_launcher_stops_at_max_restarts_with_the_last_error_as_its_last_line(monkeypatch, capsys):
    status, starts = _main_with([KILLED] * 3, monkeypatch, "-n", 1, "--max-restarts", 2)
    assert (status, starts) == (1, [0, 1, 2])
    assert [line.split(":")[0] for line in capsys.readouterr().err.splitlines()] == [
        "restart 1 of 2", "restart 2 of 2", "error"]


@pytest.mark.parametrize("ending, status", [
    (Ending(PROCESS_FAILED, "worker 0 (pid 7) exited with status 2; it printed nothing", 2), 2),
    (Ending(INTERRUPTED, "interrupted by SIGTERM; stopped the 3 processes of the job", signum=signal.SIGTERM), 143),
], ids=["status 2", "SIGTERM"])
def test_the_launcher_does_not_restart_what_the_policy_stops(ending, status, monkeypatch, capsys):
    assert _main_with([ending], monkeypatch, "-n", 1, "--max-restarts", 2) == (status, [0])
    assert capsys.readouterr().err.splitlines() == [f"error: {ending.message}"]


# Joins the job, sums every worker's 1 and prints what it saw; with argv[2] == "die", the worker of rank 1 on
# the job's first start SIGKILLs itself after joining; with "exit N" every worker exits with N on every start.
WORKER_SCRIPT = """
import os, signal, sys
import mxnet as mx
kv = mx.kv.create('dist_sync')
restart = int(os.environ["PARALLEL_RESTART"])
action = sys.argv[2:]
if action[:1] == ["exit"]:
    sys.exit(int(action[1]))
if action == ["die"] and restart == 0 and kv.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
a = mx.nd.zeros(2)
kv.init(5, a)
kv.push(5, mx.nd.ones(2))
kv.pull(5, out=a)
print(f"restart {restart}: rank {kv.rank} of {kv.num_workers} summed {a.asnumpy()[0]:g}", flush=True)
"""


def _lines(stdout, prefix="restart"):
    return sorted(line.split("] ", 1)[1] for line in stdout.splitlines() if "] " + prefix in line)


@pytest.mark.slow
def test_a_dead_worker_restarts_the_job(tmp_path, mark):
    script = write_script(tmp_path, "worker.py", WORKER_SCRIPT)
    result = run_launcher(mark, "-n", 2, "-s", 1, "--max-restarts", 2, "--grace", 2, sys.executable, script,
                          tmp_path, "die")
    assert result.returncode == 0, result.stderr
    restarts = [line for line in result.stderr.splitlines() if line.startswith("restart ")]
    assert len(restarts) == 1, result.stderr
    assert restarts[0].startswith("restart 1 of 2: worker ") and "was killed by SIGKILL" in restarts[0]
    assert restarts[0].endswith("starting 2 worker(s) again")
    assert error_lines(result.stderr) == []
    assert _lines(result.stdout) == ["restart 1: rank 0 of 2 summed 2", "restart 1: rank 1 of 2 summed 2"]
    assert_nothing_left(mark)


@pytest.mark.parametrize("status, restarts", [
    pytest.param(3, ["restart 1 of 2", "restart 2 of 2"],   # restarted up to --max-restarts, then the last error
                 marks=pytest.mark.slow),                # three starts of a job: the fast tier's time budget
    pytest.param(2, [], marks=pytest.mark.slow),   # bad input: restarting would fail the same way
])
def test_a_failing_worker_is_restarted_up_to_max_restarts_unless_its_input_is_bad(status, restarts, tmp_path,
                                                                                   mark):
    script = write_script(tmp_path, "worker.py", WORKER_SCRIPT)
    result = run_launcher(mark, "-n", 1, "-s", 1, "--max-restarts", 2, "--grace", 1, sys.executable, script,
                          tmp_path, "exit", status)
    assert result.returncode == (2 if status == 2 else 1), result.stderr   # bad input passed on
    got = [line.split(":")[0] for line in result.stderr.splitlines() if line.startswith("restart ")]
    assert got == restarts, result.stderr
    (line,) = error_lines(result.stderr)
    assert f"exited with status {status}" in line
    assert result.stderr.rstrip().splitlines()[-1] == line   # the last error is the last line
    assert_nothing_left(mark)


@pytest.mark.slow
def test_the_number_of_workers_follows_the_discovery_script(tmp_path, mark):
    """2 workers, then 1, then 3 within one job: the script's hosts at each start decide."""
    slots = tmp_path / "slots"
    slots.write_text("localhost\nlocalhost\n")
    # rank 1 of the first start shrinks the job to 1 host and dies; the second start's only worker grows it to
    # 3 hosts and dies; the third start finishes
    script = write_script(tmp_path, "worker.py", """
        import os, signal, sys
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        restart = int(os.environ["PARALLEL_RESTART"])
        print(f"restart {restart}: {kv.num_workers} workers", flush=True)
        slots = os.path.join(sys.argv[1], "slots")
        if restart == 0 and kv.rank == 1:
            open(slots, "w").write("localhost\\n")
            os.kill(os.getpid(), signal.SIGKILL)
        if restart == 1:
            open(slots, "w").write("localhost\\n127.0.0.1\\nlocalhost\\n")
            os.kill(os.getpid(), signal.SIGKILL)
        if restart == 0:
            import time; time.sleep(300)   # rank 0 waits to be stopped
    """)
    result = run_launcher(mark, "-n", "1:4", "--max-restarts", 2, "--grace", 2, "--host-discovery-script",
                          f"cat {slots}", sys.executable, script, tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    # the launcher sees the death or the new list first: a restart, or a change of hosts
    restarts = [line for line in result.stderr.splitlines() if line.endswith("worker(s) again")]
    assert [line.rsplit("; ", 1)[1] for line in restarts] == ["starting 1 worker(s) again",
                                                              "starting 3 worker(s) again"], result.stderr
    assert sorted(set(_lines(result.stdout))) == ["restart 0: 2 workers", "restart 1: 1 workers",
                                                  "restart 2: 3 workers"]
    assert_nothing_left(mark)


@pytest.mark.slow
def test_too_few_hosts_end_the_job_after_the_start_timeout(tmp_path, mark):
    slots = tmp_path / "slots"
    slots.write_text("localhost\n")
    result = run_launcher(mark, "-n", "2:3", "--start-timeout", 2, "--host-discovery-script", f"cat {slots}",
                          sys.executable, "-c", "pass", timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert "only 1 host(s) available, -n asks for at least 2" in line
    assert_nothing_left(mark)


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_nothing(tmp_path, mark):
    """Its watchdog SIGKILLs every process group of the job, a worker's own child (here the Python a shell
    started) included."""
    script = write_script(tmp_path, "loop.py", LOOPING_SCRIPT)
    argv, env = launcher(mark, "-n", 2, "-s", 1, "sh", "-c", f"{sys.executable} {script} {tmp_path}; true")
    process = start_process(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_pids(tmp_path, 2, process)
        assert len(dmlc_processes(mark)) >= 5   # scheduler, server, 2 shells and their 2 Pythons
        process.kill()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            stop_process(process)
    assert_nothing_left(mark, wait=5.0)


@pytest.mark.slow
def test_a_job_that_ends_well_leaves_nothing_when_the_launcher_returns(tmp_path, mark):
    script = write_script(tmp_path, "worker.py", WORKER_SCRIPT)
    result = run_launcher(mark, "-n", 7, "-s", 2, sys.executable, script, tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    assert len(_lines(result.stdout)) == 7
    assert dmlc_processes(mark) == []   # at once: the launcher returned after every process had gone


@pytest.mark.parametrize("args, message", [
    (["-n", "0:2"], "MIN:MAX with 1 <= MIN <= MAX"),
    (["-n", "3:2"], "MIN:MAX with 1 <= MIN <= MAX"),
    (["-n", "x"], "is not a number of workers N or a range MIN:MAX"),
    (["-n", "1", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["-n", "1", "--host-discovery-script", ""], "--host-discovery-script needs a command"),
    (["-n", "1", "--launcher", "ssh", "--host-discovery-script", "true"], "needs --scheduler-host"),
    (["-n", "1:2", "--discovery-interval", "0"], "--discovery-interval must be > 0 seconds"),
    (["-n", "1:2", "--discovery-interval", "inf"], "--discovery-interval must be at most 1000000 seconds"),
    (["-n", "1:2", "--host-cooldown", "-1"], "--host-cooldown must be >= 0 seconds"),
    (["-n", "1:2", "--reset-limit", "-1"], "--reset-limit must be >= 0"),
])
def test_bad_restart_and_elastic_flags_exit_2(args, message, capsys):
    from parallel.launch import main
    assert main(args + ["python", "x.py"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and message in line


def test_a_discovery_script_naming_another_host_in_local_mode_is_refused(tmp_path, mark):
    result = run_launcher(mark, "-n", "1:2", "--host-discovery-script", "echo node7", sys.executable, "-c", "pass",
                          timeout=60)
    assert result.returncode == 2, result.stderr   # input that cannot work
    (line,) = error_lines(result.stderr)
    assert "named the host 'node7'" in line
    assert_nothing_left(mark)
