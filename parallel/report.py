"""What a run shows: the epoch line, the metrics JSON, the loss and accuracy curves.

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

from .files import atomic_write

__all__ = ["format_epoch", "write_metrics", "plot_metrics", "plot_format", "plot_formats"]


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
