"""python -m parallel.launch end to end: real kvstore jobs, every way a job can fail, and nothing left behind.

Each test marks the processes it starts with a unique environment variable and checks at the end that no
process with ``DMLC_ROLE`` and that mark is left (other jobs on the machine are not ours to judge).
"""
import io
import os
import pty
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from parallel.launch import main
from conftest import job_processes, run_process, start_process, stop_process

MARK = "PARALLEL_LAUNCH_TEST"

# Every worker joins the job, pushes its rank + 1 and pulls: without an optimizer the servers replace the
# value by the sum of the pushes, so every worker pulls 1 + 2 + ... + n.
KVSTORE_SCRIPT = """
import mxnet as mx
kv = mx.kv.create('dist_sync')
a = mx.nd.zeros(4)
kv.init(3, mx.nd.ones(4) * (kv.rank + 1))
kv.push(3, mx.nd.ones(4) * (kv.rank + 1))
kv.pull(3, out=a)
print(f"rank {kv.rank} of {kv.num_workers}: {a.asnumpy().tolist()}")
"""

# Joins the job, writes its pid to a file, then keeps pushing and pulling.
LOOPING_SCRIPT = """
import os, sys, time
import mxnet as mx
kv = mx.kv.create('dist_sync')
a = mx.nd.zeros(4)
kv.init(3, a)
with open(os.path.join(sys.argv[1], f"pid.{os.getpid()}"), "w") as f:
    f.write(str(os.getpid()))
for step in range(100000):
    kv.push(3, mx.nd.ones(4))
    kv.pull(3, out=a)
    a.wait_to_read()
    time.sleep(0.05)
"""

# The first worker to claim the file does something else (argv[2]: "exit" with 3, or "sleep"); the others join.
ONE_ODD_WORKER_SCRIPT = """
import os, sys, time
try:
    os.close(os.open(os.path.join(sys.argv[1], "claimed"), os.O_CREAT | os.O_EXCL))
except FileExistsError:
    import mxnet as mx
    mx.kv.create('dist_sync')
    time.sleep(300)
if sys.argv[2] == "exit":
    print("worker giving up", flush=True)
    sys.exit(3)
time.sleep(300)
"""


def dmlc_processes(mark):
    """Pids of live processes whose environment has ``DMLC_ROLE`` and this test's mark."""
    return job_processes(MARK, mark)


def assert_nothing_left(mark, wait=5.0):
    """No process of this test's job is left (remote ones over ssh may take a moment to get their SIGHUP)."""
    deadline = time.monotonic() + wait
    while dmlc_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dmlc_processes(mark) == [], "processes of the job were left behind"


@pytest.fixture
def mark():
    """A mark for this test's processes; afterwards, assert none is left, and SIGKILL any that is (by pid)."""
    value = uuid.uuid4().hex
    yield value
    left = dmlc_processes(value)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes {left} with DMLC_ROLE were left behind"


def launcher(mark, *args):
    """``[argv, env]`` for the launcher in a subprocess, its processes marked."""
    return [sys.executable, "-m", "parallel.launch", *map(str, args)], dict(os.environ, **{MARK: mark})


def run_launcher(mark, *args, timeout=120):
    argv, env = launcher(mark, *args)
    return run_process(argv, env=env, timeout=timeout)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def write_script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def wait_for_pids(directory, count, launcher_process, timeout=60):
    """The pids the looping workers wrote, once ``count`` of them have."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p.name.split(".")[1]) for p in directory.glob("pid.*")]
        if len(pids) == count:
            time.sleep(0.1)   # let the file's writer finish
            return pids
        assert launcher_process.poll() is None, launcher_process.communicate(timeout=30)
        time.sleep(0.1)
    raise AssertionError(f"the workers did not all start within {timeout} s")


def check_kvstore_output(result, num_workers):
    assert result.returncode == 0, result.stderr
    assert error_lines(result.stderr) == []
    total = float(sum(range(1, num_workers + 1)))
    lines = [line for line in result.stdout.splitlines() if line.startswith("[worker ")]
    assert len(lines) == num_workers, result.stdout
    ranks = set()
    for i in range(num_workers):   # the launch index i in the prefix, ps-lite's rank in the line
        (line,) = [line for line in lines if line.startswith(f"[worker {i}] rank ")]
        rank, of, values = line.split("rank ")[1].partition(f" of {num_workers}: ")
        assert of and values == str([total] * 4), line
        ranks.add(int(rank))
    assert ranks == set(range(num_workers))
    assert f"the scheduler is connected to {num_workers} workers" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("num_workers, num_servers", [(2, 1), (3, 2)])
def test_kvstore_job_sums_every_workers_push(num_workers, num_servers, tmp_path, mark):
    script = write_script(tmp_path, "job.py", KVSTORE_SCRIPT)
    result = run_launcher(mark, "-n", num_workers, "-s", num_servers, sys.executable, script)
    check_kvstore_output(result, num_workers)
    assert "Barrier count" not in result.stderr   # the scheduler's chatter is filtered
    assert_nothing_left(mark)


# Every worker sends the servers an optimizer (as gluon.Trainer does when it updates on the kvstore), then pushes
# its rank + 1: the servers sum the pushes and step from the initial 10, so every worker pulls 10 - 0.5 * sum.
OPTIMIZER_SCRIPT = """
import mxnet as mx
kv = mx.kv.create('dist_sync')
kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
a = mx.nd.zeros(4)
kv.init(3, mx.nd.ones(4) * 10)
kv.push(3, mx.nd.ones(4) * (kv.rank + 1))
kv.pull(3, out=a)
print(f"rank {kv.rank} of {kv.num_workers}: {a.asnumpy().tolist()}")
"""


@pytest.mark.slow
def test_servers_that_receive_an_optimizer_update_with_it(tmp_path, mark):
    """The servers (``parallel.launch.server``) run ps-lite's loop without MXNet's Python package until a worker
    sends an optimizer; then they import it and update as ``python -c "import mxnet"``'s servers do. Without the
    optimizer the same pushes would leave the sum (``test_kvstore_job_sums_every_workers_push``)."""
    script = write_script(tmp_path, "job.py", OPTIMIZER_SCRIPT)
    result = run_launcher(mark, "-n", 2, "-s", 2, sys.executable, script)
    assert result.returncode == 0, result.stderr
    lines = sorted(line.split("] ", 1)[1] for line in result.stdout.splitlines() if line.startswith("[worker "))
    assert lines == [f"rank {r} of 2: {[10 - 0.5 * 3] * 4}" for r in range(2)], result.stdout
    assert_nothing_left(mark)


def test_a_server_process_loads_mxnet_s_library_as_mxnet_does_and_refuses_a_worker_s_role():
    """``parallel.launch.server`` finds libmxnet where MXNet's import would (``MXNET_LIBRARY_PATH`` first) without
    importing MXNet's package, and a process without a scheduler's or server's ``DMLC_ROLE`` exits 2 at once."""
    import mxnet as mx
    from parallel.launch.server import library_path
    mxnet_s = mx.libinfo.find_lib_path()[0]
    assert library_path() == mxnet_s
    code = ("import os, sys; from parallel.launch.server import library_path; "
            "os.environ['MXNET_LIBRARY_PATH'] = sys.argv[1]; print(library_path(), 'mxnet' in sys.modules)")
    result = run_process([sys.executable, "-c", code, mxnet_s], timeout=60)
    assert result.stdout.split() == [mxnet_s, "False"], result.stderr
    env = {name: value for name, value in os.environ.items() if name != "DMLC_ROLE"}
    for role in ({}, {"DMLC_ROLE": "worker"}):
        result = run_process([sys.executable, "-m", "parallel.launch.server"], env=dict(env, **role), timeout=60)
        assert (result.returncode, result.stderr) == (
            2, "error: DMLC_ROLE must be scheduler or server (the launcher sets it)\n"), result


def test_launcher_never_imports_mxnet(mark):
    code = ("import sys; from parallel.launch import main; "
            "status = main(['-n', '1', '-s', '1', sys.executable, '-c', 'print(42)']); "
            "print('mxnet imported:', 'mxnet' in sys.modules, 'status:', status)")
    result = run_process([sys.executable, "-c", code], env=dict(os.environ, **{MARK: mark}),
                            timeout=60)
    assert "[worker 0] 42" in result.stdout, result.stderr
    assert "mxnet imported: False status: 0" in result.stdout, result.stderr
    assert_nothing_left(mark)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["every worker exits", "one worker exits, the others wait in the kvstore"])
def test_worker_failing_at_start_ends_the_job_at_once(case, tmp_path, mark):
    if case == "every worker exits":
        command = [sys.executable, "-c", "import sys; print('worker giving up'); sys.exit(3)"]
    else:
        command = [sys.executable, write_script(tmp_path, "odd.py", ONE_ODD_WORKER_SCRIPT), tmp_path, "exit"]
    result = run_launcher(mark, "-n", 3, "-s", 1, "--start-timeout", 120, *command, timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert line.startswith("error: worker ") and "exited with status 3" in line and "worker giving up" in line
    assert_nothing_left(mark)


@pytest.mark.slow
def test_nonexistent_command_ends_the_job_at_once(mark):
    result = run_launcher(mark, "-n", 2, "--start-timeout", 120, "no-such-command-xyz", timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert "worker 0 could not start" in line and "no-such-command-xyz" in line
    assert_nothing_left(mark)


@pytest.mark.slow
def test_sigkill_of_a_worker_mid_job_ends_the_job(tmp_path, mark):
    script = write_script(tmp_path, "loop.py", LOOPING_SCRIPT)
    argv, env = launcher(mark, "-n", 2, "-s", 1, "--grace", 5, sys.executable, script, tmp_path)
    process = start_process(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = wait_for_pids(tmp_path, 2, process)
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        out, err = process.communicate(timeout=60)
        seconds = time.monotonic() - killed
    finally:
        if process.poll() is None:
            stop_process(process)
    print(f"\nfrom SIGKILL of a worker to the launcher's exit: {seconds:.2f} s")
    assert process.returncode == 1, err
    (line,) = error_lines(err)
    assert f"(pid {pids[1]}) was killed by SIGKILL" in line and line.startswith("error: worker ")
    assert_nothing_left(mark)


@pytest.mark.slow
def test_start_timeout_names_the_missing_worker(tmp_path, mark):
    script = write_script(tmp_path, "odd.py", ONE_ODD_WORKER_SCRIPT)
    started = time.monotonic()
    result = run_launcher(mark, "-n", 2, "-s", 1, "--start-timeout", 15, "--grace", 2,
                          sys.executable, script, tmp_path, "sleep", timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert "did not start within 15 s (--start-timeout)" in line
    assert "1 of 2 workers and 1 of 1 servers" in line and "missing: 1 worker;" in line
    assert elapsed < 15 + 45, elapsed   # ended by the start timeout, with room for a loaded machine
    assert_nothing_left(mark)


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_everything(sig, status, tmp_path, mark):
    script = write_script(tmp_path, "loop.py", LOOPING_SCRIPT)
    argv, env = launcher(mark, "-n", 2, "-s", 1, sys.executable, script, tmp_path)
    process = start_process(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_pids(tmp_path, 2, process)
        process.send_signal(sig)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            stop_process(process)
    assert process.returncode == status, err
    (line,) = error_lines(err)
    assert f"interrupted by {sig.name}" in line
    assert_nothing_left(mark)


@pytest.mark.slow
def test_stall_timeout_ends_a_silent_job(tmp_path, mark):
    result = run_launcher(mark, "-n", 1, "-s", 1, "--stall-timeout", 2, "--start-timeout", 120,
                          sys.executable, "-c", "import time; time.sleep(300)", timeout=60)
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert "no worker printed a line for 2 s (--stall-timeout)" in line
    assert_nothing_left(mark)


def _listening_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("case", ["-n 0", "missing hostfile", "empty hostfile", "ssh without hostfile",
                                  "no command", "port in use", "hostfile without ssh", "bad hostfile line",
                                  "abbreviated flag", "grace inf", "grace 1e12", "start timeout inf",
                                  "stall timeout 1e12"])
def test_user_errors_exit_2_with_one_line(case, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("# no hosts yet\n\n")
    bad = tmp_path / "bad"
    bad.write_text("node1:ssh\n")
    with _listening_port() as busy:
        args, message = {
            "-n 0": (["-n", "0", "python", "x.py"],
                     "-n/--num-workers must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got 0"),
            "missing hostfile": (["-n", "1", "--launcher", "ssh", "-H", str(tmp_path / "nope"), "python", "x.py"],
                                 "cannot read the hostfile"),
            "empty hostfile": (["-n", "1", "--launcher", "ssh", "-H", str(empty), "python", "x.py"], "names no host"),
            "ssh without hostfile": (["-n", "1", "--launcher", "ssh", "python", "x.py"], "needs -H/--hostfile"),
            "no command": (["-n", "2"], "no command given"),
            "port in use": (["-n", "1", "--port", str(busy.getsockname()[1]), "python", "x.py"], "is not free"),
            "hostfile without ssh": (["-n", "1", "-H", str(empty), "python", "x.py"], "applies to --launcher ssh"),
            "bad hostfile line": (["-n", "1", "--launcher", "ssh", "-H", str(bad), "python", "x.py"], "line 1"),
            # argparse would take --num-work for --num-workers; a flag is spelled out or refused
            "abbreviated flag": (["--num-work", "2", "python", "x.py"], "required: -n/--num-workers"),
            # a wait that long overflowed Python's waits (OverflowError) once the job had succeeded
            "grace inf": (["-n", "1", "--grace", "inf", "true"], "--grace must be at most 1000000 seconds"),
            "grace 1e12": (["-n", "1", "--grace", "1e12", "true"], "--grace must be at most 1000000 seconds"),
            "start timeout inf": (["-n", "1", "--start-timeout", "inf", "true"], "--start-timeout must be at most"),
            "stall timeout 1e12": (["-n", "1", "--stall-timeout", "1e12", "true"], "--stall-timeout must be at most"),
        }[case]
        assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.slow
def test_user_error_in_a_subprocess_is_one_line():
    result = run_process([sys.executable, "-m", "parallel.launch", "-n", "0", "python", "x.py"],
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr == "error: -n/--num-workers must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got 0\n"


# ssh mode, against an sshd of our own on 127.0.0.1.

@pytest.fixture
def sshd(tmp_path):
    """An sshd on a free loopback port that lets root in with a fresh key; yields the launcher's ssh flags."""
    if not os.path.exists("/usr/sbin/sshd") or os.geteuid() != 0:
        pytest.skip("needs sshd: ssh mode needs /usr/sbin/sshd and root (to start a private sshd that accepts "
                    "root's key); "
                    "install openssh-server")
    directory = tmp_path / "sshd"
    directory.mkdir()
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)], check=True,
                       timeout=60)
    shutil.copy(directory / "client_key.pub", directory / "authorized_keys")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = directory / "sshd_config"
    config.write_text(textwrap.dedent(f"""\
        Port {port}
        ListenAddress 127.0.0.1
        HostKey {directory / 'host_key'}
        AuthorizedKeysFile {directory / 'authorized_keys'}
        PermitRootLogin prohibit-password
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        UsePAM no
        StrictModes no
        PidFile {directory / 'sshd.pid'}
        """))
    os.makedirs("/run/sshd", exist_ok=True)   # sshd's privilege separation directory
    daemon = start_process(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.communicate(timeout=10)[1]
            time.sleep(0.05)
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"# the test's sshd\n127.0.0.1:{port}\n")
        yield ["--launcher", "ssh", "-H", hostfile, "--env", MARK,
               "--ssh-option", f"IdentityFile={directory / 'client_key'}",
               "--ssh-option", f"UserKnownHostsFile={directory / 'known_hosts'}"]
    finally:
        stop_process(daemon)


@pytest.mark.slow
def test_ssh_kvstore_job(sshd, tmp_path, mark):
    script = write_script(tmp_path, "job.py", KVSTORE_SCRIPT)
    result = run_launcher(mark, "-n", 2, "-s", 1, *sshd, sys.executable, script)
    check_kvstore_output(result, 2)
    assert_nothing_left(mark)


@pytest.mark.slow
def test_ssh_remote_processes_end_with_the_job(sshd, tmp_path, mark):
    """Stopping the local ssh (here at the start timeout) ends the remote processes too (-tt: SIGHUP)."""
    result = run_launcher(mark, "-n", 2, "-s", 1, "--start-timeout", 5, "--grace", 2, *sshd,
                          sys.executable, "-c", "import time; time.sleep(300)", timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert "did not start within 5 s" in line and "missing: 2 workers" in line
    assert_nothing_left(mark)


# A worker of a LeNet job (one context, lr 0.1, a global batch of 8) taking sys.argv[1] steps, one fewer on rank 1
# (uneven inputs), or issuing another key than rank 0 at its second sum (sys.argv[2] == "keys"), or another size
# ("sizes": ps-lite's server aborts); it reads its parameters at the end, which waits for its last sum.
DISAGREEING_SCRIPT = """
import sys
import mxnet as mx
from parallel import Reducer, get_params, init_lenet_params, train_batch
from parallel.job import allreduce_across, join
job = join()
if sys.argv[2] in ("keys", "sizes"):
    for i in range(2):
        key = 50 + i + (job.rank if i and sys.argv[2] == "keys" else 0)
        size = 4 + (2 * job.rank if i and sys.argv[2] == "sizes" else 0)
        print(allreduce_across(job, [mx.nd.ones((size,))], key)[0].asnumpy().tolist(), flush=True)
else:
    ctx_list = [mx.cpu(0)]
    device_params = [get_params(init_lenet_params(seed=0), ctx) for ctx in ctx_list]
    reducer = Reducer(job=job)
    X, y = mx.nd.ones((8, 1, 28, 28)), mx.nd.zeros((8,))
    steps = int(sys.argv[1]) - (job.rank == 1)
    for step in range(steps):
        train_batch(X, y, device_params, ctx_list, lr=0.1, reducer=reducer)
    device_params[0].data.wait_to_read()
print(f"rank {job.rank} done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one step short", "keys", "sizes"])
def test_workers_that_disagree_end_the_job_with_a_diagnosis(case, tmp_path, mark):
    """No timeout chosen: the workers' flight records prove the divergence, the launcher prints each worker's last
    collectives and Python stack, and one error line naming where each worker is; nothing is left running."""
    script = write_script(tmp_path, "disagree.py", DISAGREEING_SCRIPT)
    result = run_launcher(mark, "-n", 2, sys.executable, script, 4, case, timeout=120)
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    if case == "sizes":   # the server aborts first: its failure, and what the records prove
        assert "Check failed" in line and ("the workers disagree: rank 0 issued init #3 (step 0, key 51, 16 B) where "
                                           "rank 1 issued init #3 (step 0, key 51, 24 B)") in line, line
        assert_nothing_left(mark)
        return
    assert line.startswith("error: the workers disagree: ")
    if case == "keys":
        assert ("rank 0 issued init #3 (step 0, key 51, 16 B) where rank 1 issued init #3 (step 0, key 52, 16 B)"
                in line), line
    else:   # 4 steps of 2 buckets' init + sum at the first, then one sum a step: #1 .. #12 on rank 0
        assert "rank 0 waits in allreduce #" in line and "(step 4," in line, line
        assert "rank 1 finished after #" in line and "(step 3)" in line, line
    assert "Python stack of its main thread" in result.stderr
    assert MARK not in result.stdout and "##parallel-flight##" not in result.stdout + result.stderr
    assert_nothing_left(mark)


STALLING_SCRIPT = """
import time
import mxnet as mx
from parallel.job import join
job = join()
print(f"rank {job.rank} joined", flush=True)
if job.rank == 0:   # a sum rank 1 never makes: rank 0 waits in it, silent
    job.allsum(1000, mx.nd.ones((4,))).asnumpy()
else:
    time.sleep(300)
"""


@pytest.mark.slow
def test_a_stalled_job_ends_with_where_each_worker_waits(tmp_path, mark):
    """A hang that proves no divergence (a worker still on its way, as far as the records tell) ends at
    ``--stall-timeout`` with each worker's last collectives and its main thread's Python stack, what the hang is
    read from; nothing is left running."""
    script = write_script(tmp_path, "stall.py", STALLING_SCRIPT)
    result = run_launcher(mark, "-n", 2, "--stall-timeout", 5, sys.executable, script, timeout=120)
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert "no worker printed a line for 5 s (--stall-timeout)" in line, line
    assert "rank 0 waits in allreduce #2 (step 0, key 1000, 16 B); rank 1 issued no collective yet" in line, line
    assert "flight recorder of rank 0 (2 collectives, step 0), last ones:" in result.stderr, result.stderr
    stack = result.stderr[result.stderr.index("Python stack of its main thread"):]
    assert "job.allsum(1000, mx.nd.ones((4,))).asnumpy()" in stack, result.stderr
    assert_nothing_left(mark)


# ssh mode's plan: what each remote process gets (no ssh run here).

def _ssh_plan(tmp_path, monkeypatch, *flags, hosts=("h1", "h2")):
    from parallel.launch.cli import build_parser, check_args
    from parallel.launch.processes import plan_processes
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h}\n" for h in hosts))
    args = build_parser().parse_args(["--launcher", "ssh", "-H", str(hostfile), "--scheduler-host", "10.0.0.1",
                                      *flags, "python", "job.py"])
    check_args(args)
    return args, plan_processes(args)


def test_ssh_puts_one_server_on_each_host_and_sends_what_a_local_process_inherits(tmp_path, monkeypatch):
    monkeypatch.setenv("MXNET_CPU_TEMP_COPY", "64")
    monkeypatch.setenv("DMLC_PS_VAN_TYPE", "p3")
    monkeypatch.setenv("HOME_SECRET", "not sent")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args, specs = _ssh_plan(tmp_path, monkeypatch, "-n", "4")
    remote = [s for s in specs if s.role != "scheduler"]
    assert [(s.role, s.host) for s in remote] == [("server", "h1"), ("server", "h2"), ("worker", "h1"),
                                                 ("worker", "h2"), ("worker", "h1"), ("worker", "h2")]
    command = remote[0].argv[-1]
    assert "MXNET_CPU_TEMP_COPY=64" in command and "DMLC_PS_VAN_TYPE=p3" in command
    assert "HOME_SECRET" not in command and "DMLC_NUM_SERVER=2" in command
    assert f"PARALLEL_JOB={args.job}" in command and "PARALLEL_HOSTS=2" in command   # the hosts it spans
    # 3 processes a host (a server, two workers): each gets a third of that host's cores, read there
    assert '"OMP_NUM_THREADS=$(( $(nproc) / 3 > 0 ? $(nproc) / 3 : 1 ))"' in command
    assert remote[0].argv[remote[0].argv.index("-o") + 1] == "ServerAliveInterval=15"   # --host-timeout 60


def test_ssh_keeps_the_users_threads_servers_and_keepalives(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _, specs = _ssh_plan(tmp_path, monkeypatch, "-n", "2", "-s", "1", "--host-timeout", "0",
                         "--ssh-option", "ServerAliveInterval=7")
    remote = [s for s in specs if s.role != "scheduler"]
    assert [s.role for s in remote] == ["server", "worker", "worker"]
    command = remote[1].argv[-1]
    assert "OMP_NUM_THREADS=3" in command and "nproc" not in command
    assert "PARALLEL_HOSTS=2" in command   # a server on h1 alone: the workers' sums still cross a link
    options = [remote[1].argv[i + 1] for i, word in enumerate(remote[1].argv) if word == "-o"]
    assert "ServerAliveInterval=7" in options and not any(o.startswith("ServerAliveCountMax") for o in options)


def test_every_process_is_told_how_many_hosts_its_job_spans(tmp_path, monkeypatch):
    """PARALLEL_HOSTS: 1 for one host by ssh and for the local launcher (the CLI's buckets stay 25 MiB there)."""
    from parallel.launch.cli import build_parser, check_args
    from parallel.launch.processes import plan_processes
    _, specs = _ssh_plan(tmp_path, monkeypatch, "-n", "2", hosts=("h1",))
    assert all("PARALLEL_HOSTS=1" in s.argv[-1] for s in specs if s.role != "scheduler")
    args = build_parser().parse_args(["-n", "3", "python", "job.py"])
    check_args(args)
    assert {s.env["PARALLEL_HOSTS"] for s in plan_processes(args)} == {"1"}


@pytest.mark.parametrize("hosts, flags, command, env, link, van", [
    (("h1", "h2"), [], ["python", "-m", "parallel.train"], {}, None, "p3"),   # auto: the CLI across hosts
    (("h1", "h2"), [], ["python", "-m", "parallel.train"], {}, 95.0, "p3"),   # ... on a slow link
    (("h1", "h2"), [], ["python", "-m", "parallel.train"], {}, 940.0, None),  # a fast one: ps-lite's own
    (("h1",), [], ["python", "-m", "parallel.train"], {}, None, None),         # one host: ps-lite's own
    (("h1", "h2"), [], ["python", "job.py"], {}, 95.0, None),                  # a script of yours: ps-lite's own
    (("h1", "h2"), ["--van", "zmq"], ["python", "-m", "parallel.train"], {}, 95.0, "zmq"),
    (("h1", "h2"), ["--van", "p3"], ["python", "job.py"], {}, 940.0, "p3"),
    (("h1", "h2"), [], ["python", "-m", "parallel.train"], {"DMLC_PS_VAN_TYPE": "zmq"}, 95.0, "zmq"),   # yours wins
    (("h1", "h2"), [], ["python", "job.py"], {"DMLC_PS_VAN_TYPE": "p3"}, None, "p3"),
])
def test_the_van_is_p3_for_the_cli_across_hosts_on_a_slow_link_unless_told_and_never_the_schedulers(
        hosts, flags, command, env, link, van, tmp_path, monkeypatch):
    from parallel.launch.cli import build_parser, check_args
    from parallel.launch.processes import hosts_to_probe, plan_processes
    monkeypatch.delenv("DMLC_PS_VAN_TYPE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h}\n" for h in hosts))
    args = build_parser().parse_args(["--launcher", "ssh", "-H", str(hostfile), "--scheduler-host", "10.0.0.1",
                                      "-n", "2", *flags, *command])
    check_args(args)
    probed = hosts_to_probe(args)   # the links are measured only where auto would choose by them
    assert probed == ([(h, None) for h in hosts] if len(hosts) > 1 and not flags and not env
                      and "parallel.train" in command else []), probed
    args.link_mbit = link
    specs = plan_processes(args)
    for spec in specs[1:]:   # the servers and workers, on the hosts
        assert (f"DMLC_PS_VAN_TYPE={van}" in spec.argv[-1]) == (van is not None), (spec.role, spec.argv[-1])
    scheduler = specs[0].env   # the scheduler runs here: the same van, ps-lite's default, or ZeroMQ under P3
    assert scheduler.get("DMLC_PS_VAN_TYPE", env.get("DMLC_PS_VAN_TYPE")) == ("zmq" if van == "p3" else van)


@pytest.mark.parametrize("value", ["-1", "nan", "2e6"])
def test_a_bad_host_timeout_is_one_line(value, capsys):
    assert main(["-n", "1", "--host-timeout", value, "python", "x.py"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --host-timeout must be")


@pytest.mark.parametrize("line, chatter", [
    ("[02:08:30] ../3rdparty/ps-lite/src/van.cc:455: Barrier count for 7 : 1", True),
    # two of ps-lite's threads writing at once: the pieces of their lines come mixed
    ("[[02:08:30] 02:08:30../3rdparty/ps-lite/src/van.cc] ../3rdparty/ps-lite/src/van.cc:455: Barrier count for 7 : 2",
     True),
    ("02:08:30] ../3rdparty/ps-lite/src/van.cc:455: ", True),
    ("[02:08:30] ../3rdparty/ps-lite/src/van.cc] 1 => 9. Meta: request=1, timestamp=3, control={ cmd=BARRIER }", True),
    ("[02:08:30] ../3rdparty/ps-lite/src/van.cc:136: Check failed: node.id != Node::kEmpty", False),
    ("terminate called after throwing an instance of 'dmlc::Error'", False),
    ("", False),
])
def test_the_schedulers_chatter_is_known_also_when_its_threads_mix_their_lines(line, chatter):
    """ps-lite's threads write their log lines piece by piece: the filter finds the chatter wherever its words
    are (it once let a mixed 'Barrier count' line through), and never hides an error."""
    from parallel.launch.job import is_ps_chatter
    assert is_ps_chatter(line) is chatter


def _fake_ssh(tmp_path, monkeypatch, body):
    """An ``ssh`` first on the PATH that runs ``body`` whatever it is asked (the link probe's)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!/bin/sh\n{body}\n")
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("body, says, link", [
    ("echo && head -c 16000000 /dev/zero", "ps-lite's ZeroMQ van (P3 below 300 Mbit/s", True),
    ("exit 255", "no link of the job's 2 hosts could be measured over ssh; the job runs on MXNet's P3 van", False),
])
def test_auto_measures_each_hosts_link_over_ssh_and_says_what_it_chose(body, says, link, tmp_path, monkeypatch,
                                                                        capsys):
    """A pipe on this machine carries far more than 300 Mbit/s: ZeroMQ; hosts that ssh cannot reach: P3, as
    before, and the start fails where it would have."""
    from parallel.launch.cli import build_parser, check_args
    from parallel.launch.job import Job
    from parallel.launch.processes import plan_processes
    monkeypatch.delenv("DMLC_PS_VAN_TYPE", raising=False)
    _fake_ssh(tmp_path, monkeypatch, body)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\n")
    args = build_parser().parse_args(["--launcher", "ssh", "-H", str(hostfile), "--scheduler-host", "10.0.0.1",
                                      "-n", "2", "python", "-m", "parallel.train"])
    check_args(args)
    Job(args, None, None).measure_links()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("--van auto: ") and says in line, line
    assert (args.link_mbit is not None and args.link_mbit >= 300) == link
    assert ("DMLC_PS_VAN_TYPE=p3" in plan_processes(args)[1].argv[-1]) != link


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_progress_bar_is_drawn_in_place_on_a_terminal_and_lines_go_above_it(monkeypatch):
    """The job's one progress display: a worker's refresh (a text a lone carriage return ends) redraws one line
    of the launcher's terminal; a line printed meanwhile clears it, goes above it, and the bar is drawn again."""
    from parallel.launch import job as launch_job
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar, other = object(), object()   # the workers that print
    launch_job.write_progress("stderr", "[rank 0]  10%|#", source=bar)
    launch_job.write_progress("stderr", "[rank 0]  20%|##", source=bar)
    launch_job.write_line("stderr", "[rank 1] a line", source=other)
    launch_job.write_line("stderr", "[rank 0] 100%|###", source=bar)   # its last state: the bar is done
    launch_job.write_line("stderr", "[rank 1] another", source=other)
    assert terminal.getvalue() == ("\r[rank 0]  10%|#\x1b[K" "\r[rank 0]  20%|##\x1b[K"
                                   "\r\x1b[K[rank 1] a line\n\r[rank 0]  20%|##\x1b[K"
                                   "\r\x1b[K[rank 0] 100%|###\n[rank 1] another\n")
    launch_job.write_progress("stderr", "[rank 0]  10%|#", source=bar)
    launch_job.end_progress()   # the job ended with the bar drawn: cleared, and not drawn again
    launch_job.write_line("stderr", "error: ...")
    assert terminal.getvalue().endswith("\r[rank 0]  10%|#\x1b[K\r\x1b[Kerror: ...\n")


def test_a_progress_bar_is_dropped_where_the_output_is_not_a_terminal(monkeypatch):
    from parallel.launch import job as launch_job
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    launch_job.write_progress("stderr", "[rank 0]  10%|#")
    launch_job.write_line("stderr", "[rank 0] the bar's last state, as a line")
    assert log.getvalue() == "[rank 0] the bar's last state, as a line\n"


PROGRESS_SCRIPT = """
import os, sys, time
print("progress", os.environ["PARALLEL_PROGRESS"], flush=True)
for pct in (10, 50, 100):
    sys.stderr.write(f"\\r {pct}%")
    sys.stderr.flush()
    time.sleep(0.05)
sys.stderr.write("\\n")
print("joined the job as rank 0 of 1 (dist_sync)", flush=True)
print("after", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("terminal", [True, False])
def test_the_launcher_draws_a_workers_bar_only_on_a_terminal_and_labels_it_by_rank_once_known(terminal, tmp_path,
                                                                                               mark):
    """Through the launcher, on a pseudo-terminal and on a pipe: the worker is told which (PARALLEL_PROGRESS); its
    refreshes are drawn in place on the terminal and dropped on the pipe, its bar's last state is a line either
    way; once it said its rank, its lines carry it. (Every refresh came as a line of its own.)"""
    script = write_script(tmp_path, "bar.py", PROGRESS_SCRIPT)
    argv, env = launcher(mark, "-n", 1, "-s", 1, sys.executable, script)
    if terminal:
        leader, follower = pty.openpty()
        process = start_process(argv, env=env, stdout=subprocess.PIPE, stderr=follower)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:   # EIO: the launcher, the last writer, has exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(leader)
        err = b"".join(chunks).decode().replace("\r\n", "\n")
        out = process.stdout.read().decode()
        assert process.wait(timeout=120) == 0, err
    else:
        result = run_process(argv, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        out, err = result.stdout, result.stderr
    assert f"[worker 0] progress {int(terminal)}" in out.splitlines(), out
    assert ("\r[worker 0]  10%\x1b[K" in err and "\r[worker 0]  50%\x1b[K" in err) == terminal, repr(err)
    # its last state, a line (labelled by launch order or by rank: the stdout reader may pass the rank's line first)
    assert {"[worker 0]  100%", "[rank 0]  100%"} & set(err.replace("\r\x1b[K", "\n").splitlines()), repr(err)
    assert out.splitlines()[-2:] == ["[worker 0] joined the job as rank 0 of 1 (dist_sync)", "[rank 0] after"], out
    assert_nothing_left(mark)
