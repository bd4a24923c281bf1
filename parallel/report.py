"""What a run shows: the epoch line, the metrics JSON, the loss and accuracy curves, and the ``Report`` of
``python -m parallel.train`` that prints and writes them.

Every file is written atomically (``parallel.files``), so an interrupted run leaves the last complete version:

>>> history = [{"epoch": 1, "train_loss": 2.3, "train_acc": 0.1, "test_acc": 0.12, "seconds": 2.0,
...             "images_per_second": 500.0}]
>>> format_epoch(history[0], ["cpu(0)", "cpu(1)"])
'epoch 1, loss 2.300, train acc 0.100, test acc 0.120, 2.0 sec/epoch, 500 examples/sec on [cpu(0), cpu(1)]'
>>> plot_metrics(history).axes[0].get_xlim()    # one epoch: the axis is centred on it
(0.5, 1.5)
"""
import functools
import json
import os
import sys

from .cli import UsageError
from .files import atomic_write

__all__ = ["format_epoch", "format_memory", "write_metrics", "plot_metrics", "plot_format", "plot_formats", "Report"]


def write_metrics(history, path):
    """Write the per-epoch metrics as a JSON list, atomically."""
    with atomic_write(path, "w") as f:
        json.dump(history, f, indent=2)
        f.write("\n")


@functools.lru_cache(maxsize=None)
def plot_formats():
    """The file formats matplotlib writes here, by suffix without the dot (``png``, ``pdf``, ``svg``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase
    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


def plot_format(path):
    """The format named by ``path``'s suffix (``"png"`` for ``curves.png``); ``ValueError`` when matplotlib
    cannot write it or there is no suffix.

    >>> plot_format("curves.PDF")
    'pdf'
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    if suffix not in plot_formats():
        raise ValueError(f"cannot tell the plot format of {os.fspath(path)!r}: end the file name with a format "
                         f"matplotlib writes, one of {', '.join('.' + f for f in plot_formats())}")
    return suffix


def plot_metrics(history, path=None, title=None):
    """Plot the loss and accuracy curves; write them to ``path`` (atomically) if given.

    Parameters
    ----------
    history : list of dict
        As returned by ``fit``.
    path : str or os.PathLike, optional
        The file's suffix names its format (``.png``, ``.pdf``, ``.svg``, ``.jpg``, ...; see
        ``plot_formats``); an unknown or missing suffix raises ``ValueError`` before anything is written.
    title : str, optional

    Returns
    -------
    matplotlib.figure.Figure
        Built without pyplot, so it never changes the plotting backend (a notebook shows it with
        ``display(fig)``).
    """
    from matplotlib.figure import Figure

    fmt = None if path is None else plot_format(path)
    epochs = [m["epoch"] for m in history]
    fig = Figure(figsize=(9, 3.5))
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, [m["train_loss"] for m in history], "o-", label="train loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [m["train_acc"] for m in history], "o-", label="train acc")
    ax_acc.plot(epochs, [m["test_acc"] for m in history], "s--", label="test acc")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend()
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if len(epochs) == 1:   # matplotlib would span 0.96..1.04 around a single point, ticks at fractions
            ax.set_xlim(epochs[0] - 0.5, epochs[0] + 0.5)
            ax.set_xticks(epochs)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format=fmt, dpi=100)
    return fig


def format_epoch(metrics, ctx_list, strategy="data", workers=1):
    """The textbook's one-line epoch summary; other strategies than data parallelism are named, and a job's
    workers counted (``ctx_list`` is then each worker's contexts)."""
    name = "" if strategy == "data" else f", {strategy} parallel"
    where = f"[{', '.join(str(c) for c in ctx_list)}]"
    return (f"epoch {metrics['epoch']}, loss {metrics['train_loss']:.3f}, "
            f"train acc {metrics['train_acc']:.3f}, test acc {metrics['test_acc']:.3f}, "
            f"{metrics['seconds']:.1f} sec/epoch, {metrics['images_per_second']:.0f} examples/sec{name} "
            f"on {where if workers == 1 else f'{workers} workers x {where}'}")


#: What a context holds for training, in ``parallel.optim.memory_table``'s rows and in this order.
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "gathered_peak", "temporary_buffers")


def format_memory(table):
    """One line: the busiest context of ``table`` (``parallel.optim.memory_table``) and what it holds, in MiB (the
    parts that are 0 left out; the total counts them all, so lines of any layout compare; docs/memory.md).

    >>> format_memory([{"context": "cpu(0)", "parameters": 2 ** 20, "gradients": 2 ** 20, "optimizer_state": 2 ** 19,
    ...                 "gathered_peak": 0, "temporary_buffers": 0}])
    'memory for training: 2.50 MiB on the busiest context, cpu(0) (parameters 1.00, gradients 1.00, optimizer state 0.50 MiB)'
    """
    busiest = max(table, key=lambda row: sum(row[part] for part in MEMORY_PARTS))
    mib = {part: busiest[part] / 2 ** 20 for part in MEMORY_PARTS}
    gathered = f", gathered parameters {mib['gathered_peak']:.2f}" if busiest["gathered_peak"] else ""
    buffers = f", temporary buffers {mib['temporary_buffers']:.2f}" if busiest["temporary_buffers"] else ""
    return (f"memory for training: {sum(mib.values()):.2f} MiB on the busiest context, {busiest['context']} "
            f"(parameters {mib['parameters']:.2f}, gradients {mib['gradients']:.2f}, optimizer state "
            f"{mib['optimizer_state']:.2f}{gathered}{buffers} MiB)")


class Report:
    """What a run shows and writes (rank 0 of a job alone): its lines, and after every epoch the metrics JSON and
    the plot.

    Parameters
    ----------
    strategy : object
        The run's strategy (its ``name`` and ``ctx_list`` name the epoch lines).
    title, data_name, layout : str
        The model's, the data's and the layout's names (``"LeNet"``, ``"synthetic"``, ``"2 context(s)"``).
    workers : int
        Workers of the job (1 in one process).
    main_rank : bool
        Whether this process prints and writes (rank 0 of a job).
    outputs : dict
        ``{flag: path or None}`` of the files written after every epoch: ``--metrics-json`` and ``--plot``.
    memory : callable, optional
        ``memory()`` gives what each context holds (``parallel.optim.memory_table``), the same measurement twice:
        after the run's first step (``step``), as the line that says what the busiest context holds, and after
        every epoch this run trains, as that epoch's ``"memory"`` in the metrics JSON. A pipeline's ``metrics()``
        (a pipeline's schedule, stashed micro-batches and bubble, as its ``"pipeline"``) too.
    """

    def __init__(self, strategy, title, data_name, layout, workers, main_rank, outputs, memory=None):
        self.strategy, self.title, self.data_name, self.layout = strategy, title, data_name, layout
        self.workers, self.main_rank, self.outputs = workers, main_rank, dict(outputs)
        self.memory, self._extra = memory, {}   # epoch -> what its metrics add: its memory table, the pipeline
        self._stepped = False

    def say(self, line):
        """Print ``line`` on stdout (rank 0 alone), clear of a progress bar on the terminal."""
        if self.main_rank:
            from tqdm import tqdm
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()

    def step(self, epoch, batch):
        """After each step is queued (``fit``'s ``on_step``): after the run's first, what the busiest context holds
        (``format_memory``), once the step has allocated what it uses (receive buffers, the optimizer's state)."""
        if not self._stepped:
            self._stepped = True
            if self.memory is not None and self.main_rank:
                self.say(format_memory(self.memory()))

    def epoch(self, metrics, history):
        """After each epoch (``fit``'s ``on_epoch``): its line, then the metrics JSON and the plot."""
        self.say(format_epoch(metrics, self.strategy.ctx_list, self.strategy.name, self.workers))
        extra = {} if self.memory is None else {"memory": self.memory()}
        extra.update(self.strategy.metrics())   # a pipeline's "pipeline"
        self._extra[metrics["epoch"]] = extra
        self.write_outputs(history)

    def write_outputs(self, history):
        """Rewrite the metrics JSON and the plot (atomically); ``UsageError`` naming the flag when one cannot be."""
        if not self.main_rank:
            return
        title = f"{self.title} on {self.data_name}, {self.strategy.name} parallel on {self.layout}"
        history = [{**m, **self._extra.get(m["epoch"], {})} for m in history]
        writers = {"--metrics-json": write_metrics, "--plot": lambda h, p: plot_metrics(h, p, title=title)}
        for flag, path in self.outputs.items():
            if path is not None:
                try:
                    writers[flag](history, path)
                except OSError as e:   # the disk filled up or the directory went away mid-run
                    raise UsageError(f"cannot write {flag} {path!r}: {e.strerror or e}") from None

    def stopped(self, state, checkpoint_dir, resume_command):
        """The outputs of a run stopped by a signal, and the line that says so."""
        if state.history:
            self.write_outputs(state.history)
        where = f"stopped at epoch {state.epoch} after {state.batch} batch(es)"
        if checkpoint_dir is None:
            return f"{where}; no --checkpoint-dir, so there is nothing to resume from"
        return f"{where}; checkpoint in {checkpoint_dir}. Resume with: {resume_command}"
