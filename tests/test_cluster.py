"""The simulated cluster of benchmarks/cluster.py, which the multi-host tests and benchmarks run on: each host has
its own address, name and shaped link, ssh reaches it over that link (so a cut link cuts the session), a client that
ends hangs up its remote command, and nothing is left once the cluster is closed."""
import subprocess
import time

import pytest

from conftest import load_benchmark

cluster = load_benchmark("cluster")


def test_the_ssh_command_line_is_read_as_openssh_reads_it():
    options, host, command = cluster.parse_ssh(["-tt", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5",
                                                "-o", "ServerAliveCountMax=2", "-p", "2222", "root@h2",
                                                "cd /x", "&&", "exec", "python"])
    assert (host, command) == ("h2", "cd /x && exec python")
    assert options["tty"] and options["port"] == 2222
    assert (options["alive_interval"], options["alive_count"]) == (5.0, 2)
    options, host, command = cluster.parse_ssh(["-q", "--", "h1", "true"])
    assert not options["tty"] and options["quiet"] and options["alive_interval"] == 0 and host == "h1"
    # options after the destination, as Horovod's runner writes them
    options, host, command = cluster.parse_ssh(["-o", "PasswordAuthentication=no", "10.77.0.2", "-p", "2222",
                                                "-tt", "cd /x", "-v"])
    assert (host, command, options["port"], options["tty"]) == ("10.77.0.2", "cd /x -v", 2222, True)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="hosts must be an int"):
        cluster.Cluster("2")
    with pytest.raises(ValueError, match="hosts must be from 1 to 200, got 0"):
        cluster.Cluster(0)
    with pytest.raises(ValueError, match="rate must be like 1gbit"):
        cluster.Cluster(2, rate="fast")
    assert cluster.main(["--hosts", "0", "--", "true"]) == 2


def test_the_bucket_is_a_millisecond_of_the_rate_and_at_least_128_kib():
    assert cluster.Cluster(1, rate="100mbit").burst == 131072
    assert cluster.Cluster(1, rate="10gbit").burst == 1250000
    assert cluster.Cluster(1, rate="1gbps").burst == 1000000


def _run(c, command, host=1, timeout=60):
    done = subprocess.run(c.wrap(["/bin/sh", "-c", command], host), env=c.env(), capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout.replace("\r\n", "\n"), done.stderr


@pytest.mark.slow
def test_each_host_has_its_name_its_address_and_sshs_fresh_environment(make_cluster, monkeypatch):
    monkeypatch.setenv("PARALLEL_TEST_SECRET", "not for remote hosts")
    c = make_cluster(3, rate="100mbit")
    assert c.addresses == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    status, out, err = _run(c, "hostname; ssh -tt h3 'hostname; hostname -I; echo ${PARALLEL_TEST_SECRET-unset} "
                               "$PWD; getent hosts h2; exit 3'; echo status=$?")
    lines = out.split("\n")
    assert lines[:4] == ["h1", "h3", "10.77.0.3 ", "unset /root"], out
    assert lines[4].split() == ["10.77.0.2", "h2"] and lines[5] == "status=3", out
    assert "Connection to h3 closed." in err
    status, out, err = _run(c, "ssh nosuchhost true")
    assert status == 255 and "Could not resolve hostname nosuchhost" in err


@pytest.mark.slow
def test_a_client_that_ends_hangs_up_its_remote_command(make_cluster):
    c = make_cluster(2)
    client = c.popen(["ssh", "-tt", "h2", "exec sleep 300"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not c.processes(2):   # the session's sleep
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.kill()
    client.wait(timeout=30)
    while c.processes(2):
        assert time.monotonic() < deadline, c.processes(2)
        time.sleep(0.05)


@pytest.mark.slow
def test_a_cut_link_times_the_client_out_and_the_remote_command_lives_on(make_cluster):
    """A partition, as a real ssh sees one: no answer to its keepalives; the command on the other side, cut off,
    runs on (and without keepalives the client would wait for ever)."""
    c = make_cluster(2)
    client = c.popen(["ssh", "-tt", "-o", "ServerAliveInterval=0.5", "-o", "ServerAliveCountMax=2", "h2",
                      "exec sleep 300"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not c.processes(2):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    c.cut(2)
    assert client.wait(timeout=30) == 255
    assert client.stderr.read() == b"Timeout, server h2 not responding.\n"
    assert len(c.processes(2)) == 1   # still running, unreachable
    status, out, err = _run(c, "ssh -o ConnectTimeout=1 h2 true")
    assert status == 255 and "connect to host h2 port 22" in err
    c.heal(2)
    assert _run(c, "ssh h2 echo back")[1] == "back\n"


@pytest.mark.slow
def test_a_link_carries_what_crosses_hosts_and_nothing_of_a_hosts_own_traffic(make_cluster):
    c = make_cluster(2, rate="100mbit")
    size, before = 4000000, (c.link_bytes(1), c.link_bytes(2))
    assert _run(c, f"head -c {size} /dev/zero | ssh h2 'cat > /dev/null'")[0] == 0
    middle = c.link_bytes(1), c.link_bytes(2)
    sent_1, received_1 = (m - b for m, b in zip(middle[0], before[0]))
    sent_2, received_2 = (m - b for m, b in zip(middle[1], before[1]))
    assert size < sent_1 < 1.1 * size and size < received_2 < 1.1 * size, (sent_1, received_2)
    assert received_1 < 0.1 * size and sent_2 < 0.1 * size   # the acknowledgements
    assert _run(c, f"head -c {size} /dev/zero | ssh h1 'cat > /dev/null'; "   # host 1 to itself
                   f"ssh h2 'head -c {size} /dev/zero | ssh h2 \"cat > /dev/null\"'")[0] == 0   # host 2 to itself
    after = c.link_bytes(1), c.link_bytes(2)
    assert all(a - m < 0.01 * size for a, m in zip(after[0] + after[1], middle[0] + middle[1])), (after, middle)


@pytest.mark.slow
def test_nothing_is_left_once_the_cluster_is_closed(make_cluster):
    c = make_cluster(2)
    c.popen(["ssh", "-tt", "h2", "exec sleep 300"], stdout=subprocess.DEVNULL)
    c.popen(["sleep", "300"], host=1)
    namespaces = [h.namespace for h in c.hosts] + [c.switch]
    c.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
    assert not any(ns in listed for ns in namespaces), listed
