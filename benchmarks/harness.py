"""What every benchmark script shares: interleaved rounds, medians and ratios, flag types, the results JSON and
tables, child processes and their ``RESULT`` lines, and the synthetic batches they train on.

It is imported, not run. A script puts its own directory at the end of ``sys.path`` and imports it, so that
``python benchmarks/NAME.py`` and the tests' ``load_benchmark`` find it alike; run a script, e.g.::

    OMP_NUM_THREADS=1 python benchmarks/trainer.py --quick

Importing it imports no MXNet (the drivers of ``distributed.py`` and ``horovod.py`` never do); the helpers that
time or build arrays import it when they are called.

- rounds: ``round_orders`` and ``interleave`` (every round visits every configuration once, in a shuffled, rotated
  or fixed order), ``timed`` (waits for MXNet's engine before and after, no garbage collection inside:
  ``no_gc``), ``warm_up``, ``time_interleaved``;
- numbers: ``median``, ``medians``, ``add_ratios`` (each record against its group's reference);
- flags: ``ArgumentParser`` (one-line errors), ``CommaList`` (``--ks 1,2,4``, ``--networks lenet``:
  ``parse_list``, refused with the flag's name), ``mnist_dir`` (``--data-dir``, refused with the command that
  makes it), ``check_minimum``, ``add_out``;
- results: ``results_path`` (checked before the long work), ``write_json`` and ``save_figure`` (atomic, through
  ``parallel.files.atomic_write``), ``figure`` (matplotlib without pyplot), ``markdown_table``, ``size_label``,
  ``run_settings``;
- a command's status: ``command_status`` (2 for refused arguments, 1 for a failed job, one ``error:`` line),
  ``command`` (SIGTERM ends a script as Ctrl-C does: its children stopped, its temporaries removed, status 130);
- processes: ``child_env``, ``run_process`` (a session of its own), ``stop_group`` (SIGTERM, then SIGKILL, to the
  whole process group), ``report_result`` / ``read_result`` (one ``RESULT {json}`` line), ``proc_environ`` /
  ``proc_parent`` (a process's environment and parent, read from ``/proc``), ``BenchmarkError``;
- data: ``random_batch``, ``write_dataset``;
- the step comparisons against ``gluon.Trainer`` (trainer.py, optimizers.py, step_time.py): ``NETWORKS``,
  ``add_network_flags``, ``network_settings``, ``gluon_network``, ``gluon_trainer``, ``gluon_step``,
  ``trainer_update``.
"""
import argparse
import contextlib
import gc
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: The repository's root: a script and its children import this work tree's package from it.
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from parallel.files import atomic_write, check_writable  # noqa: E402   (this work tree's, from ROOT)

#: Where the scripts write their results by default (``benchmarks/results``).
RESULTS = os.path.join(HERE, "results")
KB, MB = 1024, 1024 ** 2
#: How a child process reports: one line ``RESULT {json}`` (under the launcher, ``[worker i] RESULT {json}``).
RESULT_PREFIX = "RESULT "
#: The orders a round can visit the configurations in (``round_orders``).
ORDERS = ("shuffle", "rotate", "fixed")


class BenchmarkError(RuntimeError):
    """A benchmark's job or process failed; a script's ``main`` prints ``error: <message>`` (and returns 1)."""


# ---- rounds: every round visits every configuration ----------------------------------------------------------------

def round_orders(keys, rounds, order="shuffle", seed=0):
    """The order of each of ``rounds`` rounds over ``keys``: every round visits every key once, so that a slow
    spell of the machine hits every configuration alike.

    Parameters
    ----------
    keys : iterable
        The configurations, in their listed order.
    rounds : int
    order : {"shuffle", "rotate", "fixed"}
        ``shuffle``: a fresh random order every round (``random.Random(seed).sample``); ``rotate``: round ``r``
        (from 0) starts at the ``r``-th key, the listed order wrapped around; ``fixed``: the listed order.
    seed : int
        Seeds the shuffle.

    Yields
    ------
    list
        One round's keys.

    Raises
    ------
    ValueError
        For an ``order`` not in ``ORDERS``.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    keys, rng = list(keys), random.Random(seed)
    for r in range(rounds):
        if order == "shuffle":
            yield rng.sample(keys, len(keys))
        elif order == "rotate" and keys:
            yield keys[r % len(keys):] + keys[:r % len(keys)]
        else:
            yield list(keys)


def interleave(measure, keys, rounds, order="shuffle", seed=0, progress=None):
    """``measure(key)`` for every key in every round (``round_orders``); the samples of each key.

    Parameters
    ----------
    measure : callable
        ``measure(key)`` returns one sample (a number, or anything the script keeps).
    keys, rounds, order, seed
        As for ``round_orders``.
    progress : str, optional
        When given, ``"<progress> r/rounds done"`` is printed on stderr after every round.

    Returns
    -------
    dict
        key -> the list of its ``rounds`` samples, in the order they were taken.
    """
    keys = list(keys)
    samples = {key: [] for key in keys}
    for number, keys_of_round in enumerate(round_orders(keys, rounds, order, seed), 1):
        for key in keys_of_round:
            samples[key].append(measure(key))
        if progress:
            print(f"{progress} {number}/{rounds} done", file=sys.stderr, flush=True)
    return samples


@contextlib.contextmanager
def no_gc():
    """No garbage collection inside the block (a collection's pause would land in one timing); restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def timed(fn, calls=1):
    """Seconds per call of ``fn()`` over ``calls`` calls queued one after another: MXNet's engine is waited for
    before the first and after the last (the work is asynchronous), never in between. Blocks until it is done.

    Parameters
    ----------
    fn : callable
        One step, update or collective; called with no arguments.
    calls : int
        Calls timed together (at least 1).

    Returns
    -------
    float
    """
    import mxnet as mx
    mx.nd.waitall()
    with no_gc():
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        mx.nd.waitall()
        return (time.perf_counter() - start) / calls


def warm_up(fns, calls=1):
    """Call each of ``fns`` ``calls`` times (graphs, receive buffers and optimizer state are made on a first
    call), then wait for MXNet's engine."""
    import mxnet as mx
    for fn in fns:
        for _ in range(calls):
            fn()
    mx.nd.waitall()


def time_interleaved(fns, rounds, calls=1, warmup=1, order="shuffle", unit="ms"):
    """Time every function of ``fns`` once per round, interleaved (``interleave``), after ``warmup`` calls each.

    Parameters
    ----------
    fns : dict
        key -> a function with no arguments (one step).
    rounds : int
    calls : int or callable
        Calls timed together per sample, or ``calls(key)`` giving them for each key.
    warmup : int
        Untimed calls of each function first (``warm_up``).
    order : {"shuffle", "rotate", "fixed"}
        As for ``round_orders`` (seed 0).
    unit : {"ms", "s"}
        Of the samples.

    Returns
    -------
    dict
        key -> its ``rounds`` samples, each the time per call.
    """
    scale = {"ms": 1000.0, "s": 1.0}[unit]
    count = calls if callable(calls) else (lambda key: calls)
    warm_up(fns.values(), warmup)
    return interleave(lambda key: timed(fns[key], count(key)) * scale, list(fns), rounds, order)


# ---- medians and ratios --------------------------------------------------------------------------------------------

def median(values):
    """The median of ``values`` (any iterable of numbers)."""
    return statistics.median(list(values))


def medians(samples):
    """key -> the median of its samples, for a dict of lists (``interleave``'s result)."""
    return {key: median(values) for key, values in samples.items()}


def add_ratios(records, group, reference=None, value="median_ms", field="ratio"):
    """Give each record ``field``: its ``value`` over the ``value`` of its group's reference record.

    Parameters
    ----------
    records : list of dict
        Updated in place (and returned).
    group : callable
        ``group(record)`` -> the key of the records compared with one another.
    reference : callable, optional
        ``reference(record)`` is true for the record its group is compared against (the first such); default:
        the first record of each group. A group without one gets no ``field``.
    value, field : str

    Returns
    -------
    list of dict
        ``records``.
    """
    references = {}
    for record in records:
        if group(record) not in references and (reference is None or reference(record)):
            references[group(record)] = record
    for record in records:
        base = references.get(group(record))
        if base is not None:
            record[field] = record[value] / base[value]
    return records


# ---- flags ---------------------------------------------------------------------------------------------------------

_KINDS = {int: "integers", float: "numbers"}


def _alternatives(names):
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and/or {names[-1]}"


def parse_list(text, item=str, names=None, minimum=None):
    """The values of a comma-separated flag, in order, each once.

    Parameters
    ----------
    text : str
        ``"1,2,4"``, ``"lenet,resnet18"``; empty items are dropped.
    item : callable
        Converts one item (``int``, ``float``, ``str``).
    names : collection, optional
        The values allowed.
    minimum : number, optional
        The smallest value allowed.

    Returns
    -------
    list

    Raises
    ------
    ValueError
        Whose message follows the flag's name: ``"takes lenet and/or resnet18, got 'vgg'"``.
    """
    try:
        values = [item(word.strip()) for word in text.split(",") if word.strip()]
    except ValueError:
        raise ValueError(f"takes comma-separated {_KINDS.get(item, 'values')}, got {text!r}") from None
    if not values:
        raise ValueError(f"takes at least one value, got {text!r}")
    if names is not None and not set(values) <= set(names):
        raise ValueError(f"takes {_alternatives(names)}, got {text!r}")
    if minimum is not None and min(values) < minimum:
        raise ValueError(f"takes {_KINDS.get(item, 'values')} >= {minimum}, got {text!r}")
    return list(dict.fromkeys(values))


class CommaList(argparse.Action):
    """An argparse action for a flag of comma-separated values (``parse_list``): ``--ks 1,2,4`` is ``[1, 2, 4]``;
    a bad value ends the command with status 2 and the flag's name (``--networks takes lenet and/or resnet18,
    got 'vgg'``). Give the default as a list: argparse does not pass defaults through an action.

    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--ks", action=CommaList, item=int, minimum=1, default=[1, 2, 4])
    >>> parser.parse_args(["--ks", "2,4"]).ks
    [2, 4]
    """

    def __init__(self, option_strings, dest, item=str, names=None, minimum=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.item, self.names, self.minimum = item, names, minimum

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, parse_list(values, self.item, self.names, self.minimum))
        except ValueError as e:
            parser.error(f"{option_string} {e}")


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` with one-line errors: ``error: ...`` on stderr and status 2, no usage dump (``-h`` shows it).

    >>> parser = ArgumentParser(prog="x.py")
    >>> _ = parser.add_argument("--n", type=int)
    >>> try:
    ...     parser.parse_args(["--n", "two"])
    ... except SystemExit as e:
    ...     print("status", e.code)
    status 2
    """

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


#: The command that makes the digits, an MNIST-format directory (``digits_dataset.py``; sklearn, no network).
DIGITS_COMMAND = "python benchmarks/digits_dataset.py --out"


def mnist_dir(text):
    """An argparse ``type`` for ``--data-dir``: an MNIST-format directory (the four IDX files, raw or gzipped).
    A missing or incomplete one is refused at once, with the command that makes the digits there."""
    from parallel.data.folder import missing_files   # numpy, no MXNet
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a directory; make the digits there with: "
                                         f"{DIGITS_COMMAND} {text}")
    missing = missing_files(text)
    if missing:
        raise argparse.ArgumentTypeError(f"{text} has no {missing[0]} (an MNIST-format directory); make the "
                                         f"digits there with: {DIGITS_COMMAND} {text}")
    return text


def check_minimum(values, minimum=1):
    """Check the values of flags that count something: ``values`` is ``[(flag, value), ...]``.

    Raises
    ------
    ValueError
        Naming the first flag below ``minimum``: ``"--steps must be >= 1, got 0"``.
    """
    for flag, value in values:
        if value < minimum:
            raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def add_out(parser, what, default=RESULTS):
    """``--out DIR``: the directory the script writes ``what`` (its JSON, its PNG) to; default
    ``benchmarks/results``."""
    parser.add_argument("--out", default=default, help=f"directory for {what}; default benchmarks/results")


# ---- results -------------------------------------------------------------------------------------------------------

def results_path(directory, name):
    """``directory/name``, checked before the long work starts: the directory is made, and the file can be
    written (``parallel.files.check_writable``).

    Raises
    ------
    ValueError, OSError
        When it cannot be written (a directory that is a file, no permission).
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    check_writable(path, "benchmark results")
    return path


def write_json(path, result):
    """Write ``result`` as JSON to ``path`` atomically (``parallel.files.atomic_write``: a reader sees the old
    file or the new one, never a part); its directory is made. A recorded command or path names the machine's
    places as a reader would type them (``portable``). Returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as f:
        json.dump(portable(result), f, indent=1)
        f.write("\n")
    return path


#: What stands beside the repository (Horovod's venv, the team's shared notes), as a reader reaches it: ``../NAME``.
SIBLINGS = ("hvd-venv", "shared")


def portable(value):
    """``value`` (JSON's types) with this machine's paths in its strings written as a reader types them: this
    Python as ``python``, the repository's root as ``.``, what stands beside it (``SIBLINGS``) as ``../NAME``, the
    temporary directory (``tempfile.gettempdir()``, where a run's scratch files went) as ``$TMPDIR``. A tuple
    comes back a list, as JSON writes it."""
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(item) for item in value]
    if not isinstance(value, str):
        return value
    places = [(os.path.join(os.path.dirname(ROOT), name), os.path.join(os.pardir, name)) for name in SIBLINGS]
    for place, word in [(sys.executable, "python"), *places, (ROOT + os.sep, ""), (ROOT, "."),
                        (tempfile.gettempdir() + os.sep, "$TMPDIR" + os.sep)]:
        value = value.replace(place, word)
    return value


def figure(nrows=1, ncols=1, figsize=(6.4, 4.8), **subplots):
    """A matplotlib ``Figure`` on the Agg canvas and its axes (``Figure.subplots``), without pyplot and its
    global state: ``fig, (ax1, ax2) = figure(1, 2, figsize=(10, 4))``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **subplots)


def save_figure(fig, path):
    """Write ``fig`` (laid out tight) as a PNG to ``path`` atomically; its directory is made."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)


def markdown_table(header, rows):
    """The lines of a markdown table: ``header`` (the column names), its rule, and one line a row (each row a
    sequence of cells, already formatted)."""
    return (["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def size_label(nbytes):
    """``"4 KB"``, ``"64 MB"``: a power-of-two size as the tables print it."""
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def run_settings(unset="unset (MXNet: half the cores)"):
    """What a single-process run states beside its timings: ``OMP_NUM_THREADS`` (``unset`` when it is not set),
    the cores and the processor."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", unset), "cores": os.cpu_count(),
            "machine": platform.processor() or platform.machine()}


# ---- a command's status ----------------------------------------------------------------------------------------------

def command_status(check, run):
    """A benchmark command's exit status, its two phases run: ``check()`` (the arguments' values and the outputs'
    paths, before any long work), then ``run(checked)`` with what ``check`` returned (the measurements and their
    outputs).

    Returns
    -------
    int
        0; 2 with one ``error: ...`` line on stderr when ``check`` refused (``ValueError``, ``OSError``); 1 with
        one when ``run`` failed (``BenchmarkError``: a job or process of the benchmark).
    """
    try:
        checked = check()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(checked)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _terminated(signum, frame):
    """SIGTERM as Ctrl-C: a ``KeyboardInterrupt`` in the main thread, so that ``finally`` blocks run."""
    raise KeyboardInterrupt


def command(main, stopped="the runs were stopped"):
    """Run a benchmark's ``main()`` as a command; its exit status.

    SIGTERM ends it as Ctrl-C does: a ``KeyboardInterrupt`` that unwinds the script, so every child started by
    ``run_process`` is stopped with its process group and every ``finally`` removes what it made (a worktree, a
    temporary directory, simulated hosts); then one ``error: interrupted; STOPPED`` line and status 130. Without it
    SIGTERM ends the interpreter at once and leaves all of that behind. Each script ends with
    ``sys.exit(harness.command(main))``.
    """
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return main()
    except KeyboardInterrupt:
        print(f"error: interrupted; {stopped}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- child processes -----------------------------------------------------------------------------------------------

def child_env(**extra):
    """The environment of a benchmark's child process: this one's, with the repository first on ``PYTHONPATH``
    (the child imports this work tree's package), no job role (``DMLC_*``) inherited, and ``extra`` set."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("DMLC_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def stop_group(process, grace=10.0):
    """End ``process`` (started in a session of its own) and everything in its process group: SIGTERM (a launcher
    then stops what it started), SIGKILL after ``grace`` seconds, and SIGKILL to whatever the group still holds
    once its leader is gone (``parallel.launch.processes.kill_group``). A no-op for a group that is gone."""
    from parallel.launch.processes import kill_group
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        kill_group(process.pid, sig)
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    kill_group(process.pid, signal.SIGKILL)


def run_process(argv, env=None, cwd=ROOT, timeout=3600):
    """Run ``argv`` to its end in a session of its own; its output.

    Parameters
    ----------
    argv : list of str
    env : dict, optional
        Its environment (default: this process's).
    cwd : str
        Where it runs (default: the repository's root).
    timeout : float
        Seconds it may take; then its whole process group is killed.

    Returns
    -------
    (str, str)
        Its stdout and stderr.

    Raises
    ------
    BenchmarkError
        When it timed out or exited with a status other than 0 (the end of its stderr in the message).
    """
    command = " ".join(argv[:8]) + (" ..." if len(argv) > 8 else "")
    process = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(process)
        process.communicate()
        raise BenchmarkError(f"{command} timed out after {timeout:g} s; stopped its process group") from None
    except BaseException:
        stop_group(process)
        raise
    if process.returncode != 0:
        raise BenchmarkError(f"{command} failed (exit {process.returncode}): {err[-2000:]}")
    return out, err


def report_result(result):
    """Print ``result`` as the one line a child reports with: ``RESULT {json}``."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def read_result(text, what="the process"):
    """The JSON of the last ``RESULT`` line in ``text`` (a line may begin with the launcher's ``[worker i] ``).

    Raises
    ------
    BenchmarkError
        When ``text`` holds none (``what`` names who should have printed it).
    """
    lines = [line for line in text.splitlines() if RESULT_PREFIX in line]
    if not lines:
        raise BenchmarkError(f"{what} printed no {RESULT_PREFIX.strip()} line")
    return json.loads(lines[-1].split(RESULT_PREFIX, 1)[1])


def proc_environ(pid):
    """The environment process ``pid`` started with (``/proc/PID/environ``: what MXNet read there), or None when
    it cannot be read (gone, or another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def proc_parent(pid):
    """The pid of process ``pid``'s parent (``/proc/PID/stat``), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


# ---- data ----------------------------------------------------------------------------------------------------------

def random_batch(n, ctx=None):
    """A batch of ``n`` random 1x28x28 images and labels 0..9, the same every time (seed 0): ``(X, y)``."""
    import mxnet as mx
    import numpy as np
    rng = np.random.RandomState(0)
    return mx.nd.array(rng.rand(n, 1, 28, 28), ctx=ctx), mx.nd.array(rng.randint(0, 10, n), ctx=ctx)


def write_dataset(directory, dataset):
    """Write ``dataset`` (a ``parallel.data.Dataset``) as the four IDX files of an MNIST-format directory, which
    ``python -m parallel.train --data-dir`` reads; the directory is made. Returns it."""
    from parallel.data import FILES, write_idx
    os.makedirs(directory, exist_ok=True)
    for role, name in FILES.items():
        write_idx(os.path.join(directory, name), getattr(dataset, role))
    return directory


# ---- the networks the step comparisons train, and gluon.Trainer's step on them --------------------------------------

#: The networks of the step comparisons (trainer.py, optimizers.py): the textbook's LeNet and ResNet-18.
NETWORKS = ("lenet", "resnet18")
#: LeNet's global batch in them (ResNet-18's is ``--resnet-batch``).
LENET_BATCH = 256


def add_network_flags(parser, calls="steps"):
    """The flags of a step comparison: ``--ks``, ``--networks``, ``--resnet-batch``, ``--repeats``, ``--steps``
    and ``--lenet-steps`` (``calls`` names what the last two count)."""
    parser.add_argument("--ks", action=CommaList, item=int, minimum=1, default=[1, 2, 4],
                        help="numbers of CPU contexts; default 1,2,4")
    parser.add_argument("--networks", action=CommaList, names=NETWORKS, default=list(NETWORKS),
                        help="comma-separated: lenet, resnet18; default both")
    parser.add_argument("--resnet-batch", type=int, default=32, help="ResNet-18's global batch; default 32")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; default 5")
    parser.add_argument("--steps", type=int, default=2, help=f"ResNet-18 {calls} timed per repeat; default 2")
    parser.add_argument("--lenet-steps", type=int, default=8, help=f"LeNet {calls} timed per repeat; default 8")


def network_settings(args):
    """What a step comparison's JSON states of its ``add_network_flags``."""
    return {"ks": args.ks, "networks": args.networks, "repeats": args.repeats, "steps": args.steps,
            "lenet_steps": args.lenet_steps, "lenet_batch": LENET_BATCH, "resnet_batch": args.resnet_batch}


def gluon_network(network):
    """``network`` (``"lenet"`` or ``"resnet18"``) as an initialized gluon block, the same every time (seed 0):
    LeNet as ``to_gluon(init_lenet_params(seed=0))``, ResNet-18 as ``init_resnet18(seed=0)``."""
    import parallel
    from parallel.export import to_gluon
    return to_gluon(parallel.init_lenet_params(seed=0)) if network == "lenet" else parallel.init_resnet18(seed=0)


def gluon_trainer(block, ctx_list, optimizer="sgd", options=None, kvstore="device"):
    """gluon's own way, the concise chapter's: ``block`` moved to ``ctx_list``, hybridized (``static_alloc``,
    ``static_shape``), and its ``gluon.Trainer(params, optimizer, options, kvstore=kvstore)``."""
    from mxnet import gluon
    block.collect_params().reset_ctx(ctx_list)
    block.hybridize(static_alloc=True, static_shape=True)
    return gluon.Trainer(block.collect_params(), optimizer, options or {"learning_rate": 0.05}, kvstore=kvstore)


def gluon_step(net, trainer, X, y, ctx_list):
    """One step of ``gluon.Trainer``'s way as a function: ``split_and_load``, one forward and backward per
    context, ``trainer.step(len(X))``."""
    from mxnet import autograd, gluon
    loss = gluon.loss.SoftmaxCrossEntropyLoss()

    def step():
        X_shards = gluon.utils.split_and_load(X, ctx_list, even_split=False)
        y_shards = gluon.utils.split_and_load(y, ctx_list, even_split=False)
        with autograd.record():
            losses = [loss(net(X_shard), y_shard) for X_shard, y_shard in zip(X_shards, y_shards)]
        for l in losses:
            l.backward()
        trainer.step(X.shape[0])
    return step


def trainer_update(block, trainer, batch_size):
    """``Trainer.step`` alone, as a function, on the gradients ``block`` holds (a step ran before): the kvstore's
    reduction and the update, one call per parameter array."""
    from parallel.mxnet_compat import mark_gradient_fresh
    arrays = [array for param in block.collect_params().values() if param.grad_req != "null"
              for array in param.list_data()]

    def update():
        for array in arrays:   # what backward() sets: without it, step() skips every parameter
            mark_gradient_fresh(array)
        trainer.step(batch_size)
    return update
