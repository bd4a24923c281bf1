"""TensorBoard's event files of a run: ``python -m parallel.train --logdir DIR`` (``RunConfig(logdir=DIR)`` for
``fit``) writes what the run measured there, and ``tensorboard --logdir DIR`` shows it.

``Board`` is the writer (tensorboardX's ``SummaryWriter``, an install requirement: it needs protobuf alone). What
``fit`` writes, by tag:

- every optimizer step (its number, counted from the run's first over every epoch, continued by a resumed run):
  ``STEP_TAGS``: the step's mean loss, its learning rate, the global norm of its mean gradient (before clipping),
  the examples a second since the step before finished, the bytes its collectives copied between this process's
  contexts, and in a job the bytes this worker pushed to the kvstore's servers;
- every epoch (its number): ``EPOCH_TAGS`` (what the epoch's line prints), and ``memory/<context>`` for each
  context (``memory_tag``): the bytes it holds for training, its row of ``--metrics-json``'s ``memory`` added up;
- once, as text: the run's configuration (``config``), a table of ``describe_run``'s rows.

In a job rank 0 alone writes (as Horovod and torchrun users expect); the other workers compute what every worker
must (the norm of ZeRO-3's shards is a collective) and write nothing. Nothing here imports MXNet.

>>> memory_tag("cpu(0)"), memory_tag("gpu(3)")
('memory/cpu0', 'memory/gpu3')
>>> print(config_table({"epochs": 2, "strategy": "data"}))
| setting | value |
|---|---|
| epochs | 2 |
| strategy | data |
"""
import logging
import os
import re

from .validate import BadValue, check_path

__all__ = ["Board", "check_logdir", "memory_tag", "config_table", "memory_totals", "expert_scalars", "STEP_TAGS", "EPOCH_TAGS"]

#: The scalars written at every step, by their tag: what each is.
STEP_TAGS = {
    "train/loss": "the step's loss summed over the examples this process trained, over their number (in a job "
                  "rank 0's share of the batch, batch / workers)",
    "train/lr": "the learning rate of the step's update (the schedule's)",
    "train/grad_norm": "the global L2 norm of the step's mean gradient (the summed gradient over the global batch, "
                       "all parameters together), before clipping: what --clip-norm compares",
    "train/examples_per_second": "the global batch over the seconds since the step before finished",
    "comm/bytes_moved": "the bytes the step's collectives copied between this process's contexts",
    "comm/bytes_pushed": "in a job: the bytes this worker pushed to the kvstore's servers in the step (it pulls as "
                         "many back)",
}

#: The scalars written after every epoch, by their tag: the key of ``fit``'s metrics each one is.
EPOCH_TAGS = {"epoch/train_loss": "train_loss", "epoch/train_acc": "train_acc", "epoch/test_acc": "test_acc",
              "epoch/examples_per_second": "images_per_second", "job/workers": "workers"}


def check_logdir(logdir, name="logdir"):
    """Return ``logdir`` as a ``str``: a path (``BadType`` naming ``name`` otherwise) that is a directory or does
    not exist yet (``BadValue``: an existing file cannot hold event files)."""
    path = check_path(logdir, name)
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadValue(name, f"{{{name}}} {path!r} is a file, not a directory: give a directory for TensorBoard's "
                             "event files (it is created when missing)")
    return path


def memory_tag(context):
    """The tag of a context's memory (``"cpu(0)"`` -> ``"memory/cpu0"``: TensorBoard's tags hold no parentheses)."""
    return "memory/" + re.sub(r"[^A-Za-z0-9_]", "", str(context))


def expert_scalars(experts):
    """``{tag: value}`` of an epoch's ``"experts"`` (``parallel.strategies.Hybrid.epoch_metrics``): the
    auxiliary loss, the fraction of choices dropped, and the busiest expert's load over the mean (1: balanced),
    the most over the MoE layers; ``{}`` without experts.

    >>> expert_scalars({"tokens": [[30, 10], [20, 20]], "dropped": 0.25, "aux_loss": 0.011})
    {'experts/aux_loss': 0.011, 'experts/dropped': 0.25, 'experts/max_load': 1.5}
    """
    if not experts:
        return {}
    loads = [max(layer) * len(layer) / sum(layer) for layer in experts["tokens"] if sum(layer)]
    return {"experts/aux_loss": experts["aux_loss"], "experts/dropped": experts["dropped"],
            "experts/max_load": max(loads) if loads else None}


def memory_totals(table):
    """``{tag: bytes}`` of a memory table (``--metrics-json``'s ``memory``: a row a context of byte counts): each
    context's row added up."""
    return {memory_tag(row["context"]): sum(value for key, value in row.items()
                                            if key != "context" and not isinstance(value, dict))   # "activations"
            for row in table}


def config_table(rows):
    """``rows`` (``{setting: value}``) as a Markdown table, which TensorBoard's text tab shows as a table."""
    lines = ["| setting | value |", "|---|---|"]
    lines += [f"| {key} | {str(value).replace('|', '/')} |" for key, value in rows.items()]
    return "\n".join(lines)


class Board:
    """The event files of one run in ``logdir`` (created when missing), written by tensorboardX's
    ``SummaryWriter``: its own thread writes what is queued, ``close`` flushes and closes the file.

    Parameters
    ----------
    logdir : str or os.PathLike
        The directory (``check_logdir``); each run writes a file of its own there (``events.out.tfevents.*``),
        so several runs in one directory show as one run's points in TensorBoard: give each run a subdirectory.
    """

    def __init__(self, logdir):
        from tensorboardX import SummaryWriter   # protobuf's import: a moment, paid by a run that asks for it
        # A loss that diverged is written as it is (TensorBoard shows where); the run's own line says so, not
        # tensorboardX's "NaN or Inf found in input tensor." a tag
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self.logdir = check_logdir(logdir)
        # tensorboardX names a file by the second and the host: the process id keeps two runs' files apart
        self.writer = SummaryWriter(logdir=self.logdir, flush_secs=10, filename_suffix=f".{os.getpid()}")

    def scalars(self, values, step):
        """Write ``values`` (``{tag: number}``) at ``step``; None values are skipped."""
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, float(value), step)

    def text(self, tag, markdown):
        """Write ``markdown`` as the text ``tag`` (TensorBoard's text tab renders it)."""
        self.writer.add_text(tag, markdown, 0)

    def epoch(self, metrics, memory=None):
        """Write an epoch's ``metrics`` (``fit``'s: ``EPOCH_TAGS``) and, with ``memory`` (``--metrics-json``'s
        table), the bytes each context holds, at the epoch's number."""
        values = {tag: metrics[key] for tag, key in EPOCH_TAGS.items()}
        values.update(memory_totals(memory or []))
        values.update(expert_scalars(metrics.get("experts")))
        self.scalars(values, metrics["epoch"])
        self.writer.flush()   # an epoch's points on disk: a dashboard open during the run shows them

    def close(self):
        """Flush what is queued and close the event file (the run ended, failed or was interrupted)."""
        self.writer.close()
