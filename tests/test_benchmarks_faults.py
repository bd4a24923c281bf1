"""benchmarks/faults.py: what a job on two simulated hosts does under each fault. Fast tier: refused arguments exit 2
with one line and write nothing, an unavailable cluster is refused so too, and what the script reads from a job's
lines and the hosts (restarts, the reason, where it resumed, what was left) and prints as its table, from made-up
jobs. Slow tier: a short run of two scenarios end to end on real simulated hosts."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, easy_dataset, load_benchmark, start_process, stop_process, write_idx_files

pytestmark = pytest.mark.timeout(120)

bench = load_benchmark("faults")


@pytest.fixture
def data_dir(tmp_path):
    return str(write_idx_files(tmp_path, easy_dataset(num_train=40, num_test=10)))


@pytest.mark.parametrize("argv, message", [
    (["--scenarios", "host-lost,meteor"], "error: --scenarios takes host-joined, host-lost, link-outage, partition, "),
    (["--scenarios", ""], "error: --scenarios takes at least one value"),
    (["--host-timeout", "0"], "error: --host-timeout must be from 1 to 3600 seconds, got 0"),
    (["--timeout", "-5"], "error: --timeout must be from 1 to 3600 seconds, got -5"),
    (["--epochs", "2"], "error: --epochs must be >= 3, got 2"),
    (["--outage", "10"], "error: --outage must be more than 0 and less than --host-timeout (10 s), got 10"),
    (["--host-timeout", "4", "--outage", "0"], "error: --outage must be more than 0 and less than --host-timeout"),
    ([], "error: give --data-dir DIR"),   # a missing directory: test_benchmarks_harness, for every benchmark
])
def test_bad_arguments_exit_2_with_one_line(argv, message, data_dir, capsys, tmp_path):
    out = tmp_path / "out"
    given = ["--data-dir", data_dir] if argv and "--data-dir" not in argv else []
    assert bench.main(given + argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not out.exists()


def test_a_machine_without_simulated_hosts_is_refused_with_the_reason(data_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.simulated, "unavailable", lambda: "needs root (ip netns, tc)")
    assert bench.main(["--data-dir", data_dir, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "error: simulated hosts needs root (ip netns, tc)\n"
    assert not (tmp_path / "out").exists()


def test_the_default_host_timeout_is_read_from_the_launchers_help():
    from parallel.launch import build_parser
    default = build_parser().get_default("host_timeout")
    assert bench.default_host_timeout() == default


class _Job:
    """A finished launcher as ``outcome`` reads it: its timed lines, start, end and status."""

    def __init__(self, lines, status=0, started=100.0, ended=130.0):
        self.lines, self.status, self.started, self.ended = lines, status, started, ended
        self.changed = bench.threading.Condition()

    first = bench.Launched.first


def test_the_outcome_reads_the_restart_its_reason_and_where_the_job_resumed():
    restart = ("restart 1 of 2: host 10.77.0.2 stopped answering: no reply to ssh's keepalives for 10 s "
               "(--host-timeout); worker 1 there is cut off; starting 1 worker(s) again")
    job = _Job([(104.0, "out", "[worker 0] epoch 1, loss 2.3, train acc 0.1"),
                (108.0, "out", "[worker 0] epoch 2, loss 2.2, train acc 0.2"),
                (119.5, "err", restart),
                (122.0, "out", "[worker 0] restart 1 of the job: resuming from its last checkpoint"),
                (122.1, "out", "[worker 0] resuming from ckpt: epoch 3, after 10 batch(es)"),
                (129.0, "out", "[worker 0] epoch 4, loss 2.0, train acc 0.3")])
    record = bench.outcome(job, fault=109.0)
    assert record["finished"] and not record["timed_out"] and record["restarts"] == 1
    assert record["noticed_s"] == pytest.approx(10.5) and record["noticed_line"] == restart
    assert record["resumed_from"] == {"epoch": 3, "batch": 10, "in_memory": False}
    assert record["resumed_s"] == pytest.approx(13.1) and record["changes"] == []
    assert (record["job_s"], record["fault_at_s"], record["finished_after_fault_s"]) == (30.0, 9.0, 21.0)
    assert [line for _, line in record["timeline"]][2] == restart
    assert bench.outcome(_Job(job.lines[:2], status=-9), fault=None)["noticed_s"] is None


def test_the_outcome_reads_a_change_of_hosts_and_a_resume_from_a_live_workers_state():
    changed = "the job's hosts changed: 10.77.0.3 joined (2 listed, -n 1:2); starting 2 worker(s) again"
    job = _Job([(108.0, "out", "[worker 0] epoch 2, loss 2.2, train acc 0.2"),
                (109.6, "err", "took the state of step 21 (1.0 MiB) from worker 0 (pid 7, ssh to 10.77.0.2) in 0.02 s"),
                (110.0, "err", changed),
                (113.0, "out", "[worker 0] restart 1 of the job: resuming from the state a worker committed in "
                               "memory: epoch 3, after 1 batch(es)")])
    record = bench.outcome(job, fault=109.0)
    assert record["restarts"] == 0 and record["changes"] == [changed]
    assert record["noticed_s"] == pytest.approx(1.0) and record["noticed_line"] == changed
    assert record["resumed_from"] == {"epoch": 3, "batch": 1, "in_memory": True}
    assert record["resumed_s"] == pytest.approx(4.0)
    assert [line for _, line in record["timeline"]][1].startswith("took the state of step 21")


class _Hosts:
    """A cluster whose hosts hold the given pids, each listing emptied after the given number of looks."""

    def __init__(self, pids, looks):
        self.hosts, self.pids, self.looks = [1, 2], pids, looks

    def processes(self, i):
        self.looks[i] -= 1
        return self.pids[i] if self.looks[i] >= 0 else []


def test_what_is_left_behind_is_listed_until_it_is_gone():
    since = bench.time.monotonic()
    found = bench.left_behind(_Hosts({1: [], 2: [999999999]}, {1: 0, 2: 3}), set(), since, limit=30)
    assert found["h1"] == {"at_start": [], "gone_after_s": pytest.approx(0.0, abs=0.5)}
    assert found["h2"]["at_start"] == ["?"] and 0.2 <= found["h2"]["gone_after_s"] < 5
    found = bench.left_behind(_Hosts({1: [], 2: [999999999]}, {1: 0, 2: 10 ** 6}), {1}, since, limit=0.5)
    assert found["h1"] == {"lost": True}
    assert found["h2"]["gone_after_s"] is None and found["h2"]["still_left"] == ["?"]


def _record(scenario, **fields):
    record = {"scenario": scenario, "status": 0, "timed_out": False, "finished": True, "restarts": 0,
              "restart_lines": [], "error": None, "job_s": 20.0, "fault_at_s": 8.0, "noticed_s": None,
              "resumed_from": None, "host_timeout_s": 10.0,
              "left": {"h1": {"at_start": [], "gone_after_s": 0.0}, "h2": {"at_start": [], "gone_after_s": 0.0}}}
    return dict(record, **fields)


def test_the_table_says_what_each_job_did_when_it_was_noticed_and_what_was_left():
    restart = ("restart 1 of 2: host 10.77.0.2 stopped answering: no reply to ssh's keepalives for 10 s "
               "(--host-timeout); worker 1 there is cut off; starting 1 worker(s) again")
    joined = "the job's hosts changed: 10.77.0.3 joined (2 listed, -n 1:2); starting 2 worker(s) again"
    left = {"h1": {"at_start": [], "gone_after_s": 0.0},
            "h2": {"at_start": ["python -c import mxnet", "python -m parallel.train"], "gone_after_s": 9.24,
                   "gone_after_fault_s": 31.24}}
    resume = _record("scheduler-host-lost", job_s=12.0, resumed_from={"epoch": 3, "batch": 0})
    records = [_record("uninterrupted"),
               _record("partition", job_s=30.0, restarts=1, restart_lines=[restart], noticed_s=10.44,
                       noticed_line=restart, resumed_from={"epoch": 3, "batch": 10, "in_memory": True},
                       resumed_s=13.06, default_host_timeout_s=60.0, left=left, left_since="the job's end"),
               _record("host-joined", job_s=24.0, changes=[joined], noticed_s=0.83, noticed_line=joined,
                       resumed_from={"epoch": 3, "batch": 2, "in_memory": True}, resumed_s=4.26),
               _record("link-outage", job_s=25.0, outage_s=5.0, same_model=True, max_abs_difference=0.0),
               _record("scheduler-host-lost", status=-9, finished=False, job_s=9.0, resume=resume, total_s=50.5,
                       left={"h1": {"lost": True}, "h2": {"at_start": ["python"], "gone_after_s": 30.5}},
                       left_since="the fault")]
    lines = bench.render({"records": records})
    assert lines[0] == ("| scenario | what the job did | noticed after (s) | training again after (s) | "
                        "job seconds (vs uninterrupted) | left behind |")
    assert lines[2] == "| uninterrupted | finished | - | - | 20.0 | h1 none; h2 none |"
    assert lines[3] == ("| partition | finished; 1 restart(s): host 10.77.0.2 stopped answering: no reply to ssh's "
                        "keepalives for 10 s (--host-timeout); resumed from epoch 3, batch 10 (a live worker's state) "
                        "| 10.4 (--host-timeout 10; the default 60) | 13.1 | 30.0 (1.50x) | h1 none; h2 2 process(es), "
                        "gone 9.2 s after the job's end (31.2 s after the fault) |")
    assert lines[4] == ("| host-joined | finished; 1 change(s) of hosts: 10.77.0.3 joined (2 "
                        "listed, -n 1:2); resumed from epoch 3, batch 2 (a live worker's state) | 0.8 | 4.3 | "
                        "24.0 (1.20x) | h1 none; h2 none |")
    assert lines[5] == ("| link-outage | h2's link down 5 s; finished; no restart; model byte-identical to "
                        "uninterrupted | - | - | "
                        "25.0 (1.25x) | h1 none; h2 none |")
    assert lines[6] == ("| scheduler-host-lost | launcher killed with h1 (exit -9); new launch on h2 with --resume "
                        "from epoch 3, batch 0: finished | h2 emptied after 30.5 (no launcher) | - | 50.5 (2.52x): 8.0 "
                        "to the fault + 30.5 until h2 was empty + 12.0 resumed | h1 lost; h2 1 process(es), gone 30.5 "
                        "s after the fault |")


def test_a_reason_is_cut_at_its_first_semicolon_and_a_pipe_never_breaks_the_table():
    error = _record("server-killed", status=1, finished=False, restarts=0,
                    error="error: server 1 (pid 7, ssh to 10.77.0.2) exited with status 255; its last output: a | b")
    assert bench.describe(error) == ("failed (exit 1); no restart; server 1 (pid 7, ssh to 10.77.0.2) exited with "
                                     "status 255")
    assert "|" not in bench.describe(_record("x", restarts=1, restart_lines=["restart 1 of 2: a | b; c"]))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_run_of_two_scenarios_records_what_the_job_did(make_cluster, tmp_path):
    """A killed server restarts the job from its checkpoint on both hosts; a link down for a quarter of
    --host-timeout is ridden out, and the model is the uninterrupted run's, byte for byte; nothing is left on either
    host. (Half of it is not always ridden out: TCP's retransmissions back off while the link is down, so the
    first answer can come well after the link is up again.)"""
    make_cluster   # skips, with the reason, where simulated hosts cannot be made
    (tmp_path / "digits").mkdir()
    data_dir = str(write_idx_files(tmp_path / "digits", easy_dataset(num_train=600, num_test=50)))
    process = start_process([sys.executable, "benchmarks/faults.py", "--data-dir", data_dir, "--scenarios",
                             "server-killed,link-outage", "--host-timeout", "6", "--outage", "1.5", "--epochs", "3",
                             "--timeout", "240",
                             "--out", str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=780)
    except subprocess.TimeoutExpired:
        stop_process(process, grace=60)   # the script stops its jobs and removes its hosts on SIGTERM
        raise
    assert process.returncode == 0, err[-3000:]
    result = json.loads((tmp_path / "out" / "faults.json").read_text())
    records = {record["scenario"]: record for record in result["records"]}
    assert list(records) == ["uninterrupted", "server-killed", "link-outage"]
    assert records["uninterrupted"]["finished"] and records["uninterrupted"]["restarts"] == 0
    killed = records["server-killed"]
    assert killed["finished"] and killed["restarts"] == 1, killed["timeline"]
    assert "server" in killed["noticed_line"] and killed["resumed_from"] is not None
    assert 0 < killed["noticed_s"] < killed["finished_after_fault_s"]
    outage = records["link-outage"]
    assert outage["finished"] and outage["restarts"] == 0 and outage["outage_s"] == 1.5, outage["timeline"]
    assert outage["same_model"] is True, outage
    for record in records.values():
        assert all(found["gone_after_s"] is not None for found in record["left"].values()), record["left"]
    assert "| server-killed | finished; 1 restart(s): server " in out


def test_the_readme_table_is_the_one_the_results_file_renders():
    """benchmarks/README.md and docs/distributed.md show the table benchmarks/results/faults.json renders."""
    with open(f"{ROOT}/benchmarks/results/faults.json") as f:
        lines = bench.render(json.load(f))
    for doc in ("benchmarks/README.md", "docs/distributed.md"):
        with open(f"{ROOT}/{doc}") as f:
            text = f.read()
        missing = [line for line in lines if line not in text]
        assert not missing, f"{doc} lacks these lines of faults.json's table: {missing}"
