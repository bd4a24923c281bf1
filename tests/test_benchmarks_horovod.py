"""benchmarks/horovod.py: a smoke run on plain loopback writes the JSON and the table, with the Horovod row measured
(the same loss as the package's, from the same start and data) or skipped with its reason; no timings asserted.
The table, the skip reasons and the shaped network's command are checked without running a job."""
import glob
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("horovod")


@pytest.mark.slow
@pytest.mark.needs_horovod
@pytest.mark.timeout(900)
def test_smoke_run_measures_ours_and_measures_or_skips_horovod(bench, tmp_path, capsys):
    assert bench.main(["--dataset", "synthetic", "--train-size", "64", "--test-size", "32", "--batch-size", "32",
                       "--networks", "plain", "--rounds", "1", "--alone", "--timeout", "600",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "horovod.json").read_text())
    out = capsys.readouterr().out
    assert result["configs"] == ["default", "alone", "horovod"] and "error" not in result
    alone = next(run for run in result["runs"] if run["config"] == "alone")
    jobs = alone["worker_report"]["jobs"]   # two one-worker jobs, each its own epoch line; the row's is the slower
    assert len(jobs) == 2 and alone["seconds"] == max(job[-1]["seconds"] for job in jobs) > 0
    assert result["data"] == {"source": "synthetic", "train_examples": 64, "test_examples": 32}
    assert result["links"]["plain"]["gbit_per_s"] > 0
    rows = {row["config"]: row for row in result["rows"]}
    ours = rows["default"]
    assert ours["runs"] == 1 and ours["seconds"] > 0 and math.isfinite(ours["train_loss"])
    assert ours["images_per_second"] == pytest.approx(64 / ours["seconds"])
    if result["horovod_skipped"]:
        assert rows["horovod"] == {"network": "plain", "config": "horovod", "skipped": result["horovod_skipped"]}
        assert f"| horovod | skipped: {result['horovod_skipped']} |" in out
        assert not [run for run in result["runs"] if run["config"] == "horovod"]
    else:
        horovod = rows["horovod"]
        assert horovod["runs"] == 1 and horovod["seconds"] > 0 and horovod["vs_horovod"] == 1.0
        assert ours["vs_horovod"] == pytest.approx(ours["seconds"] / horovod["seconds"])
        # the same model, start, data and order, the same SGD: the same loss, but for float32 summation order
        assert horovod["train_loss"] == pytest.approx(ours["train_loss"], rel=1e-4)
        assert horovod["train_acc"] == pytest.approx(ours["train_acc"])
    for run in result["runs"]:
        assert run["left_behind"] == [] and run["round"] == 1
        workers = [p for p in run["processes"] if p["role"] == "worker" or p["role"].startswith("horovod rank")]
        assert all(p["OMP_NUM_THREADS"] == "1" for p in workers)
    assert "| link (measured) | configuration | s/epoch (median of 1) |" in out and "| plain (" in out
    if result["horovod_skipped"]:   # ours was checked; Horovod's half did not run: reported, not passed
        pytest.skip(f"needs horovod: {result['horovod_skipped']}")


def _result(horovod_skipped, runs):
    return {"settings": {"networks": ["plain", "1gbit"], "rounds": 2, "workers": 2, "batch_size": 32, "epochs": 1},
            "links": {"plain": {"gbit_per_s": 20.0}, "1gbit": {"skipped": "needs root (unshare -n, tc)"}},
            "configs": ["default", "horovod"], "horovod_skipped": horovod_skipped,
            "data": {"source": "synthetic", "train_examples": 64, "test_examples": 32}, "runs": runs}


def _run(config, seconds):
    return {"network": "plain", "config": config, "seconds": seconds, "train_loss": 2.3, "train_acc": 0.1,
            "test_acc": 0.1, "processes": [{"role": "worker", "OMP_NUM_THREADS": "1"}]}


def test_the_table_gives_medians_ratios_and_why_a_row_was_skipped(bench):
    result = _result(None, [_run("default", 3.0), _run("default", 5.0), _run("horovod", 2.0), _run("horovod", 2.0)])
    result["rows"] = bench.summarize(result)
    table = bench.format_table(result)
    assert "| plain (20.00 Gbit/s) | default | 4.00 | 16.0 | 2.00x | n/a | 2.300 | 0.100 | 0.100 |" in table
    assert "| plain (20.00 Gbit/s) | horovod | 2.00 | 32.0 | 1.00x |" in table
    assert "| 1gbit | every configuration | skipped: needs root (unshare -n, tc) |" in table

    result = _result("/nowhere/horovodrun not found (--horovodrun): create ...", [_run("default", 3.0)])
    result["rows"] = bench.summarize(result)
    table = bench.format_table(result)
    assert "| plain (20.00 Gbit/s) | default | 3.00 | 21.3 | n/a |" in table
    assert "| plain (20.00 Gbit/s) | horovod | skipped: /nowhere/horovodrun not found (--horovodrun)" in table


def test_the_link_floor_is_the_bytes_every_allreduce_moves_at_the_links_rate(bench):
    """On simulated hosts each row's floor is 2 (W - 1) / W of the gradients' bytes for each sum the timed epoch
    waits for (one fewer than its steps) at the shaped rate, in the frames' payload; half for fp16 on either side;
    none where the bytes are not the codec's alone (top-k, a warm-up) or the network is not simulated hosts'."""
    result = _result(None, [])
    result["settings"].update(networks=["hosts-100mbit"], horovod_compression="fp16", ours={
        "default": [{}, []], "half": [{}, ["--compression", "fp16"]], "topk": [{}, ["--compression", "topk:0.01"]],
        "warm": [{}, ["--compression", "fp16", "--compression-warmup", "3"]], "plain": [{}, ["--compression", "none"]]})
    result["configs"] = ["default", "half", "topk", "warm", "plain", "horovod"]
    result["links"] = {"hosts-100mbit": {}}
    # the gradients' bytes: a cross barrier's split parameters count twice, and its sums carry them once
    memory = [{"epoch": 2, "seconds": 1.0, "memory": [{"parameters": 2 * 10 ** 6, "gradients": 10 ** 6}]}]
    result["runs"] = [{**_run(config, 1.0), "network": "hosts-100mbit", "epochs": memory}
                      for config in result["configs"]]
    result["data"]["train_examples"] = 80   # batches of 32: 3 steps, whose epoch waits for 2 sums (not the last)
    full = 2 * 10 ** 6 * 8 / (1e8 * 1460 / 1514)   # 2 sums of 10**6 bytes each way
    floors = {config: bench.link_floor(result, "hosts-100mbit", config) for config in result["configs"]}
    assert floors == {"default": pytest.approx(full), "plain": pytest.approx(full), "half": pytest.approx(full / 2),
                      "horovod": pytest.approx(full / 2), "topk": None, "warm": None}
    assert bench.link_floor(result, "plain", "default") is None   # one machine's loopback: no link to fill
    result["settings"]["workers"] = 3                              # each host sends 2/3 of the bytes, not 1/2
    assert bench.link_floor(result, "hosts-100mbit", "default") == pytest.approx(full * 4 / 3)
    result["settings"]["workers"] = 2
    result["rows"] = bench.summarize(result)
    table = bench.format_table(result)
    assert f"| hosts-100mbit | default | 1.00 | 80.0 | 1.00x | {full:.2f} | 2.300 |" in table
    assert "| hosts-100mbit | topk | 1.00 | 80.0 | 1.00x | n/a | 2.300 |" in table


def test_a_missing_horovod_is_a_reason_to_skip(bench, tmp_path):
    args = bench.parse_args(["--dataset", "synthetic", "--horovodrun", str(tmp_path / "horovodrun")])
    assert args.horovod_python == str(tmp_path / "python")
    assert bench.horovod_problem(args).startswith(f"{tmp_path / 'horovodrun'} not found (--horovodrun)")
    assert bench.horovod_problem(bench.parse_args(["--dataset", "synthetic", "--no-horovod"])) == "--no-horovod"


def test_rows_of_ours_and_the_shaped_network(bench, capsys, easy_dir):
    args = bench.parse_args(["--data-dir", str(easy_dir), "--ours", "default=", "--ours", "psgd=--compression powersgd:32",
                             "--ours", "p3=DMLC_PS_VAN_TYPE=p3 A_B=1 --bucket-mb 5 --x=Y=2"])
    assert args.ours == {"default": ({}, []), "psgd": ({}, ["--compression", "powersgd:32"]),
                         "p3": ({"DMLC_PS_VAN_TYPE": "p3", "A_B": "1"}, ["--bucket-mb", "5", "--x=Y=2"])}
    command = bench.ours_command(args, "/data", args.ours["psgd"][1], "/m.json")
    assert command[-2:] == ["--compression", "powersgd:32"] and "--metrics-json" in command
    # the model Horovod trains: each worker's own BatchNorm statistics, before the row's flags (which may change it)
    assert command.index("--batchnorm-stats") < command.index("--compression")
    assert command[command.index("--batchnorm-stats") + 1] == "worker"
    assert bench.horovod_command(args, "/data")[-2:] == ["--compression", "none"]
    fp16 = bench.parse_args(["--data-dir", str(easy_dir), "--horovod-compression", "fp16"])
    assert bench.horovod_command(fp16, "/data")[-2:] == ["--compression", "fp16"]
    assert bench.wrap("plain", ["a", "b"]) == ["a", "b"]
    shaped = bench.wrap("1gbit", ["a", "b"])
    assert shaped[:3] == ["unshare", "-n", "sh"] and shaped[-2:] == ["a", "b"]
    assert "tc qdisc add dev lo root tbf rate 1gbit" in shaped[4]
    for bad in (["--ours", "horovod=--x"], ["--ours", "noequals"], ["--ours", "a=", "--ours", "a=--x"],
                ["--networks", "10gbit"], ["--horovod-compression", "int8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--data-dir", str(easy_dir), *bad])
    capsys.readouterr()


def test_the_alone_row_computes_each_workers_share_with_nothing_summed(bench, easy_dir, tmp_path, capsys):
    """``--alone``: W one-worker jobs, no launcher, each on its own consecutive W-th of the training examples (the
    whole test set) with batch B/W, so as many steps as the job's; the driver runs them at once, numbers each and
    fails with the first failure; the row has a time against Horovod's but no model figures and no link floor."""
    args = bench.parse_args(["--data-dir", str(easy_dir), "--alone", "--workers", "3", "--batch-size", "48"])
    shards = bench.prepare_shards(args, str(easy_dir), str(tmp_path))
    from parallel.data import load_idx_dataset
    full = load_idx_dataset(str(easy_dir))
    parts = [load_idx_dataset(shard) for shard in shards]
    assert [len(part.train_labels) for part in parts] == [85, 85, 85]            # 256 // 3; the last one left out
    assert (parts[1].train_images == full.train_images[85:170]).all()
    assert all((part.test_labels == full.test_labels).all() for part in parts)
    command = bench.alone_command(args, shards, ["/m0.json", "/m1.json", "/m2.json"])
    assert command[1] == "-c" and command[2] == bench.ALONE_DRIVER
    jobs = json.loads(command[3])
    assert len(jobs) == 3 and not any("parallel.launch" in job for job in jobs)
    for job, shard, path in zip(jobs, shards, ["/m0.json", "/m1.json", "/m2.json"]):
        assert job[job.index("--batch-size") + 1] == "16" and job[job.index("--data-dir") + 1] == shard
        assert job[job.index("--metrics-json") + 1] == path and job[job.index("--devices") + 1] == "cpu:1"

    script = ("import os, sys; os.write(1, (os.environ['{}'] + '\\n').encode()); sys.exit(int(sys.argv[1]))"
              .format(bench.ALONE_JOB))   # one write each, which a pipe keeps whole (print's could interleave)
    ran = subprocess.run([sys.executable, "-c", bench.ALONE_DRIVER, json.dumps(
        [[sys.executable, "-c", script, code] for code in ("0", "3", "0")])], capture_output=True, text=True,
        timeout=60)
    assert ran.returncode == 3 and sorted(ran.stdout.split()) == ["0", "1", "2"]

    for bad in (["--alone", "--batch-size", "63"], ["--ours", "alone=--x"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--data-dir", str(easy_dir), *bad])
    capsys.readouterr()

    result = _result(None, [_run("default", 3.0), _run("horovod", 4.0),
                            dict(_run("alone", 2.0), train_loss=None, train_acc=None, test_acc=None)])
    result["configs"] = ["default", "alone", "horovod"]
    result["rows"] = bench.summarize(result)
    table = bench.format_table(result)
    assert "| plain (20.00 Gbit/s) | alone | 2.00 | 32.0 | 0.50x | n/a | n/a | n/a | n/a |" in table
    assert "alone: 2 one-worker jobs at once" in table


def test_a_run_records_the_cpu_seconds_of_its_processes_by_role_and_the_machines(bench, tmp_path):
    """``run_job`` reads each marked process's CPU seconds while the job runs and sums them by kind of role: a job
    whose two numbered processes each burn 1 s of CPU and then sleep past several readings shows most of that
    (the kernel counts CPU time in ticks, not exactly); the driver, which only waits, shows little; the machine's
    seconds over the run cover the job's."""
    burn = ("import os, sys, time\n"
            "while time.process_time() < 1.0: pass\n"
            "time.sleep(3 * {poll})\n").format(poll=bench.POLL_SECONDS)
    result = bench.run_job([sys.executable, "-c", bench.ALONE_DRIVER, json.dumps([[sys.executable, "-c", burn]] * 2)],
                           dict(os.environ), str(tmp_path), timeout=120)
    assert result["returncode"] == 0 and result["left_behind"] == []
    jobs = result["cpu_seconds"]["alone job"]
    assert jobs["processes"] == 2 and jobs["user"] + jobs["system"] >= 1.2
    assert result["cpu_seconds"]["other"]["processes"] == 1     # the driver, which only waits
    assert result["cpu_seconds"]["other"]["user"] < 0.5
    machine = result["machine_cpu_seconds"]
    assert set(machine) == set(bench.MACHINE_FIELDS) and machine["user"] + machine["system"] >= 1.2
    assert bench.cpu_by_role({1: {"role": "horovod rank 0"}, 2: {"role": "horovod rank 1"}, 3: {"role": "server"}},
                             {1: (1.0, 0.5), 2: (2.0, 0.25), 3: (0.5, 0.5)}) == {
        "horovod rank": {"user": 3.0, "system": 0.75, "processes": 2},
        "server": {"user": 0.5, "system": 0.5, "processes": 1}}


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def test_a_process_that_execs_into_a_marked_one_is_found_with_its_new_role(bench):
    """The stand-in ssh's remote shell ``exec``s into the worker: the pid read before the ``exec`` (not marked, or
    not yet a worker) must be read again once its command line changes, or the worker's CPU seconds go uncounted
    (``cpu_seconds`` once showed 1 worker of 2)."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != bench.MARK}
    child = subprocess.Popen(["sh", "-c", f"read line; exec env {bench.MARK}={mark} DMLC_ROLE=worker sleep 30"],
                             env=env, stdin=subprocess.PIPE, start_new_session=True)
    try:
        known = {}
        assert child.pid not in bench.marked_processes(mark, known) and child.pid in known
        child.stdin.write(b"go\n")
        child.stdin.close()
        deadline = time.monotonic() + 10
        while not _cmdline(child.pid).startswith(b"sleep") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bench.marked_processes(mark, known)[child.pid]["role"] == "worker"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)


def test_the_horovod_worker_keeps_as_many_steps_in_flight_as_fit():
    from parallel.fit import IN_FLIGHT
    assert load_benchmark("horovod_worker").IN_FLIGHT == IN_FLIGHT


def test_on_simulated_hosts_each_tool_runs_one_worker_a_host_over_ssh(bench):
    args = bench.parse_args(["--dataset", "synthetic", "--networks", "hosts-1gbit,hosts-100mbit"])
    assert args.networks == ["hosts-1gbit", "hosts-100mbit"]

    class Where:
        hosts, hostfile = ["10.77.0.1", "10.77.0.2"], "/h.txt"
    ours = bench.ours_command(args, "/data", [], "/m.json", Where())
    assert ours[ours.index("--launcher"):ours.index("--launcher") + 8] == [
        "--launcher", "ssh", "-H", "/h.txt", "--scheduler-host", "10.77.0.1", "--env", "PYTHONPATH"]
    assert ours.index("--env") < ours.index("parallel.train")   # the launcher's flag: each host imports this tree
    horovod = bench.horovod_command(args, "/data", Where())
    assert horovod[horovod.index("-H") + 1] == "10.77.0.1:1,10.77.0.2:1"
    assert horovod[horovod.index("--network-interface") + 1] == "eth0"
    assert "--launcher" not in bench.ours_command(args, "/data", [], "/m.json")


@pytest.mark.slow
@pytest.mark.needs_horovod
@pytest.mark.timeout(900)
def test_smoke_run_on_two_simulated_hosts_counts_the_link(bench, make_cluster, tmp_path):
    """Both tools on two simulated hosts (skipped, with the reason, where they cannot be made): the same loss, and
    the bytes host 1's link carried recorded for each run."""
    make_cluster   # skips where simulated hosts cannot be made
    assert bench.main(["--dataset", "synthetic", "--train-size", "64", "--test-size", "32", "--batch-size", "32",
                       "--networks", "hosts-1gbit", "--rounds", "1", "--timeout", "600", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "horovod.json").read_text())
    assert "error" not in result and result["runs"]
    for run in result["runs"]:
        assert run["link_bytes_host1"]["sent"] > 0 and run["link_bytes_host1"]["received"] > 0
        assert not run["left_behind"]
    losses = {run["config"]: run["train_loss"] for run in result["runs"]}
    if "horovod" not in losses:   # ours was checked on the hosts; Horovod's half did not run
        pytest.skip(f"needs horovod: {result['horovod_skipped']}")
    assert losses["horovod"] == pytest.approx(losses["default"], rel=1e-5)


def test_horovods_venv_is_an_option_beside_the_repository_by_default(bench, tmp_path, monkeypatch, capsys):
    """No path of the machine the benchmark was written on: Horovod's venv defaults to ../hvd-venv beside the
    repository wherever the command runs, --horovod-venv names another (relative to where it runs), and the skip
    reason says where the way to make one is written (benchmarks/README.md), in the checkout."""
    import os
    monkeypatch.chdir(tmp_path)
    root = bench.harness.ROOT
    venv = os.path.normpath(os.path.join(root, os.pardir, "hvd-venv"))
    args = bench.parse_args(["--dataset", "synthetic"])
    assert (args.horovod_venv, args.horovodrun, args.horovod_python) == (
        venv, os.path.join(venv, "bin", "horovodrun"), os.path.join(venv, "bin", "python"))
    other = bench.parse_args(["--dataset", "synthetic", "--horovod-venv", "venvs/hvd"])
    assert (other.horovodrun, other.horovod_python) == (str(tmp_path / "venvs/hvd/bin/horovodrun"),
                                                        str(tmp_path / "venvs/hvd/bin/python"))
    assert bench.horovod_problem(other) == (f"{tmp_path / 'venvs/hvd/bin/horovodrun'} not found (--horovodrun): make "
                                            "Horovod's venv (--horovod-venv) as benchmarks/README.md says ('Against "
                                            "Horovod')")
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "--horovod-venv DIR" in help_text and root not in help_text
    for name in ("horovod.py", "horovod_worker.py", "README.md"):   # the sources and their docs
        text = open(os.path.join(root, "benchmarks", name)).read()
        assert root not in text and not re.search(r"(?<![\w.])/(work|root|home|shared)/", text), name
    readme = open(os.path.join(root, "benchmarks", "README.md")).read()
    assert "HOROVOD_WITH_MXNET=1" in readme and "python3.11 -m venv ../hvd-venv" in readme


def test_the_benchmarks_readme_quotes_issue_47_s_bucket_runs_as_their_results_files_hold_them():
    """Each table of ``benchmarks/results/issue47/*/horovod.json`` appears row for row in benchmarks/README.md."""
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    paths = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "issue47", "*", "horovod.json")))
    assert paths
    for path in paths:
        with open(path) as f:
            table = json.load(f)["table"].split("\n\n")[0]
        rows = [line for line in table.splitlines()[2:] if "skipped" not in line]   # its measured rows
        assert rows and all(row in readme for row in rows), path


def _readme_words():
    """benchmarks/README.md with every run of white space one space, as its wrapped sentences read."""
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        return " ".join(f.read().split())


def _issue47_runs(name):
    """``benchmarks/results/issue47/NAME/horovod.json``, its table's rows as ``{config: row}`` and its runs as
    ``{config: {round: run}}``."""
    with open(os.path.join(ROOT, "benchmarks", "results", "issue47", name, "horovod.json")) as f:
        result = json.load(f)
    rounds = {}
    for run in result["runs"]:
        rounds.setdefault(run["config"], {})[run["round"]] = run
    return result, {row["config"]: row for row in result["rows"]}, rounds


def _sums_cost(rows):
    """What the sums add to the compute: our epoch over the alone jobs', less 1."""
    return rows["default"]["seconds"] / rows["alone"]["seconds"] - 1


def _sums_an_epoch(result):
    """The sums a results file's epoch waits for: one fewer than its steps (as its link floor counts them)."""
    return math.ceil(result["data"]["train_examples"] / result["settings"]["batch_size"]) - 1


def _floor_figures():
    """benchmarks/README.md's sentences on issue 47's link floor runs (two hosts, and three) and on the cross barrier's
    prototype, rebuilt from their results files."""
    rows, rounds = {}, {}
    for name in ("floor_links", "floor_fp16", "hosts3_auto", "floor_order", "cross_prototype", "cross_prototype_fp16"):
        with open(os.path.join(ROOT, "benchmarks", "results", "issue47", name, "horovod.json")) as f:
            result = json.load(f)
        sums = _sums_an_epoch(result)
        for row in result["rows"]:
            rows[name, row["network"], row["config"]] = {**row, "sums": sums}
        for run in result["runs"]:
            rounds.setdefault((name, run["network"], run["config"]), {})[run["round"]] = run["seconds"]

    def over(name, network, config, aim=None):   # the epoch (or ``aim`` x Horovod's) over the floor, and per sum
        row, horovod = rows[name, network, config], rows[name, network, "horovod"]
        seconds = row["seconds"] if aim is None else aim * horovod["seconds"]
        return seconds / row["link_floor"], (seconds - row["link_floor"]) / row["sums"]

    def by_round(name, network="hosts-1gbit", config="default", against="horovod"):   # "0.78x, 0.82x and 0.90x"
        ours, theirs = rounds[name, network, config], rounds[name, network, against]
        ratios = [f"{ours[n] / theirs[n]:.2f}x" for n in sorted(ours)]
        return f"{', '.join(ratios[:-1])} and {ratios[-1]} round by round"

    slow, horovod = over("floor_links", "hosts-100mbit", "default"), over("floor_links", "hosts-100mbit", "horovod")
    fp16, horovod16 = over("floor_fp16", "hosts-100mbit", "fp16"), over("floor_fp16", "hosts-100mbit", "horovod")
    ordered = rows["floor_order", "hosts-100mbit", "pushthenpull"]["seconds"] / rows[
        "floor_order", "hosts-100mbit", "default"]["seconds"]
    aim, aim16 = over("floor_links", "hosts-100mbit", "default", 0.9), over("floor_fp16", "hosts-100mbit", "fp16", 0.85)
    cross, plain = rows["cross_prototype", "hosts-100mbit", "cross"], rows["cross_prototype", "hosts-100mbit", "default"]
    cross16, plain16 = (rows["cross_prototype_fp16", "hosts-100mbit", config] for config in ("crossfp16", "fp16"))
    return [f"**1 Gbit/s**: our epoch is {over('floor_links', 'hosts-1gbit', 'default')[0]:.2f}x the floor",
            f"Horovod's epoch: {rows['floor_links', 'hosts-1gbit', 'default']['vs_horovod']:.2f}x here "
            f"({by_round('floor_links')}), not reached",
            f"{rows['hosts3_auto', 'hosts-1gbit', 'default']['vs_horovod']:.2f}x Horovod's epoch on three hosts "
            f"({by_round('hosts3_auto')})",
            f"{rows['floor_links', 'hosts-100mbit', 'default']['vs_horovod']:.2f}x Horovod's epoch; our epoch is "
            f"{slow[0]:.2f}x the floor, Horovod's {horovod[0]:.2f}x",
            f"epoch would be {aim[0]:.2f}x the floor: {aim[1]:.2f} s a sum above the link's time, where our epoch "
            f"spends {slow[1]:.2f} s",
            f"{rows['floor_fp16', 'hosts-100mbit', 'fp16']['vs_horovod']:.2f}x Horovod's epoch; our epoch is "
            f"{fp16[0]:.2f}x the floor, Horovod's {horovod16[0]:.2f}x",
            f"The push and pull took {ordered:.2f}x the pushpull's epoch "
            f"({by_round('floor_order', 'hosts-100mbit', 'pushthenpull', 'default')})",
            f"0.85x would be {aim16[0]:.2f}x the floor: {aim16[1]:.2f} s a sum above the link's time, where ours "
            f"spends {fp16[1]:.2f} s",
            f"the prototype took {cross['seconds'] / plain['seconds']:.2f}x the default's epoch "
            f"({by_round('cross_prototype', 'hosts-100mbit', 'cross', 'default')}), {cross['vs_horovod']:.2f}x "
            f"Horovod's; {over('cross_prototype', 'hosts-100mbit', 'cross')[0]:.2f}x the floor, "
            f"{over('cross_prototype', 'hosts-100mbit', 'cross')[1]:.2f} s a sum above the link's time where the "
            f"default spends {over('cross_prototype', 'hosts-100mbit', 'default')[1]:.2f} s",
            f"**fp16**: {cross16['seconds'] / plain16['seconds']:.2f}x the default's epoch "
            f"({by_round('cross_prototype_fp16', 'hosts-100mbit', 'crossfp16', 'fp16')}): nothing gained. In this run "
            f"the default spent {over('cross_prototype_fp16', 'hosts-100mbit', 'fp16')[1]:.2f} s a sum"]


def test_the_benchmarks_readme_reads_the_link_floor_runs_as_their_results_files_hold_them():
    """What benchmarks/README.md says of issue 47's link floor runs (two hosts with and without fp16, three hosts, the
    order alone, the cross barrier's prototype): each figure rebuilt from the runs' rows and rounds."""
    readme = _readme_words()
    missing = [figure for figure in _floor_figures() if figure not in readme]
    assert not missing, "benchmarks/README.md does not say what the floor runs hold:\n" + "\n".join(missing)


def _by_round(rounds, config, against):
    """``rounds``' (``_issue47_runs``) epoch of ``config`` over ``against``'s, round by round: "0.78x, 0.82x and 0.90x
    round by round"."""
    ratios = [f"{rounds[config][n]['seconds'] / rounds[against][n]['seconds']:.2f}x" for n in sorted(rounds[config])]
    return f"{', '.join(ratios[:-1])} and {ratios[-1]} round by round"


def _cpu_median(rounds, config, role=None, field=None, times=("user", "system")):
    """The median over ``rounds``' runs of ``config`` of the CPU seconds (``times``: user and system, or one of them)
    its processes of ``role`` used, or else of the machine's ``field`` (idle, softirq), or else of every field of the
    machine's but idle."""
    def read(run):
        if role:
            return sum(run["cpu_seconds"][role][time] for time in times)
        return sum(seconds for key, seconds in run["machine_cpu_seconds"].items()
                   if (key == field if field else key != "idle"))
    return statistics.median(read(run) for run in rounds[config].values())


def _compute_floor_figures():
    """benchmarks/README.md's sentences on issue 47's compute floor runs at 1 Gbit/s, rebuilt from their results
    files: the alone jobs' epoch and ours against Horovod's, ours against the alone jobs', and (second run) the
    runs' CPU seconds, medians over the rounds."""
    runs = {}
    for name in ("compute_floor_1gbit", "compute_floor_1gbit_cpu"):
        runs[name] = _issue47_runs(name)[1:]
    cpu = runs["compute_floor_1gbit_cpu"][1]
    figures = []
    for name, which in (("compute_floor_1gbit", "first"), ("compute_floor_1gbit_cpu", "second")):
        rows, rounds = runs[name]
        alone, ours = rows["alone"]["vs_horovod"], rows["default"]["vs_horovod"]
        figures += [f"the {which} run {alone:.2f}x Horovod's epoch ({_by_round(rounds, 'alone', 'horovod')})",
                    f"ours {ours:.2f}x ({_by_round(rounds, 'default', 'horovod')}), "
                    f"{_sums_cost(rows) + 1:.2f}x the alone jobs' epoch",
                    f"at most {0.75 / alone - 1:.2f} of the compute in the {which} run, where they cost "
                    f"{_sums_cost(rows):.2f}"]
    figures += [f"idle for {_cpu_median(cpu, 'default', field='idle'):.1f} CPU seconds of our job, "
                f"{_cpu_median(cpu, 'alone', field='idle'):.1f} of the alone jobs and "
                f"{_cpu_median(cpu, 'horovod', field='idle'):.1f} of Horovod's",
                f"our job kept them busy for {_cpu_median(cpu, 'default'):.1f} CPU seconds where the alone jobs did "
                f"for {_cpu_median(cpu, 'alone'):.1f}: the workers used {_cpu_median(cpu, 'default', 'worker'):.1f} "
                f"against the alone jobs' {_cpu_median(cpu, 'alone', 'alone job'):.1f}, the servers "
                f"{_cpu_median(cpu, 'default', 'server'):.1f}, and the kernel's softirq work "
                f"{_cpu_median(cpu, 'default', field='softirq'):.1f}"]
    return figures


def test_the_benchmarks_readme_reads_the_compute_floor_runs_as_their_results_files_hold_them():
    """What benchmarks/README.md says of issue 47's compute floor runs: each figure rebuilt from the runs."""
    readme = _readme_words()
    missing = [figure for figure in _compute_floor_figures() if figure not in readme]
    assert not missing, "benchmarks/README.md does not say what the compute floor runs hold:\n" + "\n".join(missing)


def _compute_floor_again_figures():
    """benchmarks/README.md's sentences on issue 47's compute floor runs measured again (two hosts and three at 1
    Gbit/s, two at 100 Mbit/s), rebuilt from their results files, CPU seconds as medians over the rounds."""
    figures = []
    for name in ("compute_floor_again_1gbit", "compute_floor_hosts3", "compute_floor_100mbit"):
        result, rows, rounds = _issue47_runs(name)
        ours, alone, horovod = rows["default"], rows["alone"], rows["horovod"]

        def system(config, role):
            return _cpu_median(rounds, config, role, times=("system",))

        figures += [f"ours {ours['vs_horovod']:.2f}x Horovod's epoch ({_by_round(rounds, 'default', 'horovod')}), "
                    f"{_sums_cost(rows) + 1:.2f}x the alone jobs' epoch, which took "
                    f"{alone['vs_horovod']:.2f}x Horovod's ({_by_round(rounds, 'alone', 'horovod')})",
                    f"busy for {_cpu_median(rounds, 'default'):.1f} CPU seconds in our job, "
                    f"{_cpu_median(rounds, 'alone'):.1f} in the alone jobs and {_cpu_median(rounds, 'horovod'):.1f} "
                    f"in Horovod's, idle for {_cpu_median(rounds, 'default', field='idle'):.1f}, "
                    f"{_cpu_median(rounds, 'alone', field='idle'):.1f} and "
                    f"{_cpu_median(rounds, 'horovod', field='idle'):.1f}",
                    f"our workers used {_cpu_median(rounds, 'default', 'worker'):.1f} "
                    f"({system('default', 'worker'):.1f} in the kernel) against the alone jobs' "
                    f"{_cpu_median(rounds, 'alone', 'alone job'):.1f} ({system('alone', 'alone job'):.1f}), the "
                    f"servers {_cpu_median(rounds, 'default', 'server'):.1f}, "
                    f"the kernel's softirq work {_cpu_median(rounds, 'default', field='softirq'):.1f}; Horovod's "
                    f"ranks {_cpu_median(rounds, 'horovod', 'horovod rank'):.1f} "
                    f"({system('horovod', 'horovod rank'):.1f} in the kernel)"]
        if result["settings"]["networks"] == ["hosts-1gbit"]:
            figures.append(f"would leave the sums at most {0.75 / alone['vs_horovod'] - 1:.2f} of the compute; they "
                           f"cost {_sums_cost(rows):.2f}")
        else:
            figures.append(f"our epoch {ours['seconds'] / ours['link_floor']:.2f}x its link floor, Horovod's "
                           f"{horovod['seconds'] / horovod['link_floor']:.2f}x")
    return figures


def test_the_benchmarks_readme_reads_the_compute_floor_runs_measured_again_as_their_results_files_hold_them():
    """What benchmarks/README.md says of the compute floor measured again: each figure rebuilt from the runs."""
    readme = _readme_words()
    missing = [figure for figure in _compute_floor_again_figures() if figure not in readme]
    assert not missing, "benchmarks/README.md does not say what the runs hold:\n" + "\n".join(missing)
    costs = [f"{_sums_cost(_issue47_runs(name)[1]):.2f}"
             for name in ("compute_floor_again_1gbit", "compute_floor_hosts3")]
    with open(os.path.join(ROOT, "docs", "distributed.md")) as f:
        assert f"the sums cost {costs[0]} and {costs[1]} of the compute" in " ".join(f.read().split())


def test_the_benchmarks_readme_reads_the_fp16_van_runs_as_their_results_file_holds_them():
    """benchmarks/README.md on fp16 over either van at 100 Mbit/s: the ZeroMQ van's epoch over P3's, round by
    round, and the cores idle for at least a third of every run's CPU seconds."""
    readme = _readme_words()
    result, _, rounds = _issue47_runs("fp16_vans")
    ratios = [f"{rounds['fp16zmq'][n]['seconds'] / rounds['fp16'][n]['seconds']:.2f}x" for n in sorted(rounds["fp16"])]
    assert f"The ZeroMQ van took {' and '.join(ratios)} P3's epoch round by round" in readme
    assert "idle for at least a third of every run's CPU seconds" in readme
    assert all(3 * run["machine_cpu_seconds"]["idle"] >= sum(run["machine_cpu_seconds"].values())
               for run in result["runs"])


def _forward_leads(timeline, steps):
    """For each of ``steps`` (``parallel.trace.traced_sums``) but the last, in ms, how long before its last sum landed
    the next forward pass began (negative: after): the first forward operator of lane 0 after the first layers'
    bucket (the highest number, the last backward fills) was queued."""
    forwards = sorted(e["ts"] for e in timeline.events
                      if e.get("ph") == "X" and e.get("cat") == "forward" and e.get("tid") == 0 and e.get("pid") == 0)
    leads = []
    for step in steps[:-1]:
        first_layers = max(step, key=lambda b: b["args"]["bucket"])
        start = next(ts for ts in forwards if ts > first_layers["ts"])
        leads.append((max(b["ts"] + b["dur"] for b in step) - start) / 1000)
    return leads


def _trace_figures(name):
    """What a traced 100 Mbit/s run (``benchmarks/results/issue47/NAME``) shows of the link on rank 0: the order its
    sums landed in, the link's idle time from a step's last sum landing to the next step's first bucket leaving, and
    each step's sums (first bucket leaving to last sum landing) over the link floor's time a sum."""
    from parallel.trace import read_trace, reduction_order, traced_sums
    result, rows, _ = _issue47_runs(name)
    per_sum = rows["tr"]["link_floor"] / _sums_an_epoch(result)
    timeline = read_trace(os.path.join(ROOT, "benchmarks", "results", "issue47", name, "trace.rank0.json"))
    brackets = traced_sums(timeline)
    steps = [(min(b["ts"] for b in step) / 1000, max(b["ts"] + b["dur"] for b in step) / 1000) for step in brackets]
    orders = "; ".join(", ".join(map(str, order)) for order in reduction_order(timeline))
    gaps = " and ".join(f"{later[0] - earlier[1]:.0f} ms" for earlier, later in zip(steps, steps[1:]))
    spans = [(end - start) / 1000 for start, end in steps]
    leads = " and ".join(f"{abs(lead):.0f} ms {'before' if lead > 0 else 'after'}"
                         for lead in _forward_leads(timeline, brackets))
    return orders, gaps, (" and ".join(f"{span:.2f} s" for span in spans) + ", " +
                          " and ".join(f"{span / per_sum:.2f}x" for span in spans) +
                          f" the link floor's time a sum ({per_sum:.2f} s)"), leads


def _cross_again_figures():
    """benchmarks/README.md's sentences on the cross barrier's prototype measured again and on the traces of the
    default and of the prototype at 100 Mbit/s, rebuilt from their results files."""
    _, rows, rounds = _issue47_runs("cross_again")
    ratio = lambda config: rows[config]["seconds"] / rows["default"]["seconds"]   # noqa: E731
    floor = rows["default"]["link_floor"]
    default, held = _trace_figures("trace_100mbit"), _trace_figures("trace_100mbit_hold")
    return [f"`hold` took {ratio('hold'):.2f}x the default's epoch ({_by_round(rounds, 'hold', 'default')}), "
            f"{rows['hold']['seconds'] / floor:.2f}x the link floor where the default took "
            f"{rows['default']['seconds'] / floor:.2f}x",
            f"`sched22` took {ratio('sched22'):.2f}x ({_by_round(rounds, 'sched22', 'default')})",
            f"`holdzmq` took {ratio('holdzmq'):.2f}x ({_by_round(rounds, 'holdzmq', 'default')})",
            f"the default's sums landed in the order {default[0]}",
            f"the prototype's in the order {held[0]}",
            f"the link carried no sum for {default[1]} in the default's steps and for {held[1]} in the "
            f"prototype's",
            f"a step's sums took {default[2]} in the default",
            f"and {held[2]} in the prototype",
            f"the next forward pass began {default[3]} the step's last sum landed in the default, {held[3]} it "
            f"in the prototype"]


def _cross_barrier_figures():
    """benchmarks/README.md's sentences on the cross barrier as built, rebuilt from its results file: its epoch
    against the default's and Horovod's (medians and round by round), and every row's against the link floor."""
    _, rows, rounds = _issue47_runs("cross_barrier")
    over = lambda config, against: rows[config]["seconds"] / rows[against]["seconds"]   # noqa: E731
    floor = lambda config: rows[config]["seconds"] / rows[config]["link_floor"]   # noqa: E731
    aim = 0.9 * rows["horovod"]["seconds"] / rows["horovod"]["link_floor"]
    return [f"`cross` took {over('cross', 'default'):.2f}x the default's epoch "
            f"({_by_round(rounds, 'cross', 'default')}) and {over('cross', 'horovod'):.2f}x Horovod's "
            f"({_by_round(rounds, 'cross', 'horovod')}); the default {over('default', 'horovod'):.2f}x Horovod's",
            f"`cross` {floor('cross'):.2f}x, the default {floor('default'):.2f}x, Horovod {floor('horovod'):.2f}x",
            f"Issue 47's 0.9x of Horovod's epoch would be {aim:.2f}x the floor here: not reached",
            _cross_fast_figure(), _cross_fp16_figure()]


def _cross_fp16_figure():
    """The sentence on the cross barrier with fp16 at 100 Mbit/s, from its results file."""
    _, rows, rounds = _issue47_runs("cross_barrier_fp16")
    floor = lambda config: rows[config]["seconds"] / rows[config]["link_floor"]   # noqa: E731
    aim = 0.85 * floor("horovod")
    over = lambda config: rows["crossfp16"]["seconds"] / rows[config]["seconds"]   # noqa: E731
    return (f"`crossfp16` took {over('fp16'):.2f}x fp16's epoch ({_by_round(rounds, 'crossfp16', 'fp16')}) and "
            f"{over('horovod'):.2f}x Horovod's ({_by_round(rounds, 'crossfp16', 'horovod')}): "
            f"{floor('crossfp16'):.2f}x the link floor, fp16 without it {floor('fp16'):.2f}x, Horovod "
            f"{floor('horovod'):.2f}x. Issue 47's 0.85x of Horovod's epoch would be {aim:.2f}x the floor here: not "
            f"reached")


def _cross_fast_figure():
    """The sentence on the cross barrier at 1 Gbit/s, from its results file."""
    _, rows, rounds = _issue47_runs("cross_barrier_1gbit")
    return (f"`cross` took {rows['cross']['seconds'] / rows['default']['seconds']:.2f}x the default's epoch there "
            f"({_by_round(rounds, 'cross', 'default')})")


def test_the_benchmarks_readme_and_docs_read_the_cross_barrier_as_its_results_file_holds_it():
    """What benchmarks/README.md, docs/reducer.md and docs/distributed.md say of the cross barrier's run."""
    readme = _readme_words()
    missing = [figure for figure in _cross_barrier_figures() if figure not in readme]
    assert not missing, "benchmarks/README.md does not say what the run holds:\n" + "\n".join(missing)
    _, rows, rounds = _issue47_runs("cross_barrier")
    over = f"{rows['cross']['seconds'] / rows['default']['seconds']:.2f}x the default's"
    horovod = f"{rows['cross']['seconds'] / rows['horovod']['seconds']:.2f}x Horovod's"
    reducer = " ".join(open(os.path.join(ROOT, "docs", "reducer.md")).read().split())
    distributed = " ".join(open(os.path.join(ROOT, "docs", "distributed.md")).read().split())
    assert f"{over} epoch ({_by_round(rounds, 'cross', 'default')}) and {horovod}" in reducer
    _, fast, _ = _issue47_runs("cross_barrier_1gbit")
    assert f"at 1 Gbit/s its epoch took {fast['cross']['seconds'] / fast['default']['seconds']:.2f}x" in reducer
    assert f"its epoch was {over} and {horovod}" in distributed


def test_the_benchmarks_readme_reads_the_cross_barrier_measured_again_as_its_results_files_hold_them():
    """What benchmarks/README.md says of the cross barrier's prototype measured again (both vans, the held orders)
    and of the default's 100 Mbit/s trace (the link's idle time between steps): each figure rebuilt from the files."""
    readme = _readme_words()
    missing = [figure for figure in _cross_again_figures() if figure not in readme]
    assert not missing, "benchmarks/README.md does not say what the runs hold:\n" + "\n".join(missing)
