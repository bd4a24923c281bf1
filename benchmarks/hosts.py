"""How many bytes each host's link carries a step when a job sums its gradients through MXNet's parameter servers,
on simulated hosts (``benchmarks/cluster.py``, root), against a ring allreduce's 2(W-1)/W of the gradients.

Each configuration runs a job of W workers (one a host) under ``python -m parallel.launch --launcher ssh`` whose
workers sum one array of ``--params`` float32 values (ResNet-18's 11,689,512 by default: its gradients, one
bucket's worth at a time as the Reducer sends them) ``--steps`` times and once more ``--steps`` + ``--extra``
times; the difference of the bytes each host's link carried (tc's counters on both ends, headers included),
divided by ``--extra``, is what one step costs, free of the job's start (its registrations and the first push that
initialises the servers). Servers: one on each host (the launcher's default with ``--launcher ssh``), or one in all
(``-s 1``). Run from the repository root, as root::

    python benchmarks/hosts.py                          # 2 and 3 hosts at 1 Gbit/s each way
    python benchmarks/hosts.py --quick                  # a smoke run: 2 hosts, a small array

It writes ``hosts.json`` to ``--out`` (default ``benchmarks/results``) and prints the table.
"""
import argparse
import os
import shlex
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # harness.py and cluster.py, beside this script
import cluster as simulated  # noqa: E402
import harness  # noqa: E402

#: ResNet-18's trained parameters: the bytes of its gradients, the array each step sums.
RESNET18_PARAMS = 11689512
#: The worker each job runs: join the job, sum one array STEPS times, report.
WORKER = """
import sys
import mxnet as mx
from parallel.job import allreduce_across, join
job = join()
x = mx.nd.ones((int(sys.argv[1]),))
for step in range(int(sys.argv[2])):
    allreduce_across(job, [x], 7)
x.wait_to_read()
print("done", job.rank, flush=True)
"""


def ring_share(workers):
    """What a ring allreduce sends (and receives) a host, in units of the gradients' bytes: 2(W-1)/W.

    >>> ring_share(2), round(ring_share(3), 3)
    (1.0, 1.333)
    """
    return 2 * (workers - 1) / workers


def _job_bytes(cluster, args, servers, steps, cwd):
    """Run one job of ``steps`` sums on every host of ``cluster``; each host's ``(sent, received)`` bytes."""
    before = [cluster.link_bytes(i) for i in range(1, len(cluster.hosts) + 1)]
    flags = ["-n", str(len(cluster.hosts)), "--launcher", "ssh", "-H", cluster.hostfile, "--scheduler-host",
             cluster.host(1).address, "--env", "OMP_NUM_THREADS:1"] + (["-s", str(servers)] if servers else [])
    argv = [sys.executable, "-m", "parallel.launch", *flags, sys.executable, "-c", WORKER, str(args.params),
            str(steps)]
    harness.run_process(cluster.wrap(argv, 1), env=cluster.env(), cwd=cwd, timeout=args.timeout)
    after = [cluster.link_bytes(i) for i in range(1, len(cluster.hosts) + 1)]
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]


def measure(args, hosts, servers):
    """One configuration: per host, the bytes sent and received a step, and in units of the gradients."""
    grads = 4 * args.params
    with simulated.Cluster(hosts, None if args.rate == "none" else args.rate) as cluster, tempfile.TemporaryDirectory() as cwd:
        short = _job_bytes(cluster, args, servers, args.steps, cwd)
        long = _job_bytes(cluster, args, servers, args.steps + args.extra, cwd)
    per_step = [((ls - ss) / args.extra, (lr - sr) / args.extra) for (ss, sr), (ls, lr) in zip(short, long)]
    return {"hosts": hosts, "servers": servers or hosts, "gradient_bytes": grads,
            "sent": [s for s, _ in per_step], "received": [r for _, r in per_step],
            "sent_share": [s / grads for s, _ in per_step], "received_share": [r / grads for _, r in per_step],
            "ring_share": ring_share(hosts)}


def render(result):
    """The table: each host's link a step, in MB and in units of the gradients, beside the ring's share."""
    rows = []
    for record in result["records"]:
        for i, (sent, received) in enumerate(zip(record["sent_share"], record["received_share"]), 1):
            rows.append([record["hosts"], record["servers"], f"h{i}", f"{record['sent'][i - 1] / 1e6:.1f}",
                         f"{record['received'][i - 1] / 1e6:.1f}", f"{sent:.2f}", f"{received:.2f}",
                         f"{record['ring_share']:.2f}"])
    return harness.markdown_table(["hosts", "servers", "host", "sent MB/step", "received MB/step", "sent / G",
                                   "received / G", "ring 2(W-1)/W"], rows)


def run(args, path):
    """Every configuration; the table and the JSON (at ``path``)."""
    records = []
    for hosts in args.hosts:
        for servers in (None, 1) if hosts > 1 else (None,):
            records.append(measure(args, hosts, servers))
    result = {"command": "python benchmarks/hosts.py " + shlex.join(args.argv), "rate": args.rate,
              "params": args.params, "steps": args.steps, "extra": args.extra, "records": records}
    harness.write_json(path, result)
    print("\n".join(render(result)))


def main(argv=None):
    """The command (see the module's docstring); its exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", action=harness.CommaList, item=int, minimum=1, default=[2, 3],
                        help="numbers of hosts, comma-separated; default 2,3")
    parser.add_argument("--rate", default="1gbit", help="each link's rate each way (tc's), or none; default 1gbit")
    parser.add_argument("--params", type=int, default=RESNET18_PARAMS, help="float32 values summed a step")
    parser.add_argument("--steps", type=int, default=2, help="sums of the shorter job; default 2")
    parser.add_argument("--extra", type=int, default=4, help="sums the longer job adds; default 4")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take; default 600")
    parser.add_argument("--quick", action="store_true", help="2 hosts, 1,000,000 values, 1 + 2 steps")
    harness.add_out(parser, "hosts.json")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.hosts, args.params, args.steps, args.extra = [2], 1000000, 1, 2

    def check():
        harness.check_minimum([("--params", args.params), ("--steps", args.steps), ("--extra", args.extra)])
        reason = simulated.unavailable()
        if reason:
            raise ValueError(f"simulated hosts {reason}")
        return harness.results_path(args.out, "hosts.json")
    return harness.command_status(check, lambda path: run(args, path))


if __name__ == "__main__":
    sys.exit(harness.command(main))
