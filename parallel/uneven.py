"""Uneven inputs: workers with different numbers of batches train together to the end (PyTorch's ``Join``).

Every collective waits for every worker, so a worker that runs out of batches one step before the others leaves
them waiting forever in that step's allreduce (the launcher ends such a job with a diagnosis: ``parallel.flight``).
``Join`` lets it keep answering instead. Each worker trains on batches of its own (its shard of the data, any
size) through ``join.train_batch``; before each step the workers sum two numbers, how many of them still have a
batch and how many examples they hold, so the step divides the summed gradient by the examples actually trained
on. A worker that left its ``with`` block (no batch left) answers every later step with a zero gradient
(``parallel.step.idle_step``: the same collectives, the same update) until no worker has a batch; then every
worker leaves together. Each step is therefore the step one process would take on the union of the batches the
workers still had: the replicas of every worker stay equal.

    job = parallel.job.join()
    reducer = parallel.Reducer(job=job)
    with Join(device_params, ctx_list, reducer, optimizer=optimizer) as join:
        for X, y in my_shard_of_the_batches:       # any number of batches, any sizes
            loss = join.train_batch(X, y)
    # here every worker has finished every step

It costs one small blocking sum a step (the count has to be read before the step divides by it). Without a job
(one process) it is the plain step.
"""
from .job import sum_values
from .models.lenet import lenet_cached, softmax_cross_entropy
from .optim.zero import as_optimizer
from .comm.reducer import as_reducer
from .comm.statistics import across_workers
from .step import DeviceReplicas, idle_step, statistics_job, step_replicas

__all__ = ["Join"]


class Join:
    """Train on uneven inputs across the workers of a job (see the module's docstring).

    Parameters
    ----------
    device_params : list
        This worker's replicas (``get_params``), one per context of ``ctx_list``.
    ctx_list : list of Context
        This worker's contexts.
    reducer : parallel.Reducer or str
        How the gradients are summed; its ``job`` (``parallel.job.join()``) is the job whose workers join.
    lr : float, optional
        Plain SGD at this rate; give ``lr`` or ``optimizer``.
    optimizer : parallel.optim.Optimizer, optional
        The update rule (pass the same object at every step).
    net, loss : callable
        The network ``net(X, params)`` and the per-example loss, as ``train_batch`` takes them.

    Attributes
    ----------
    steps, idle_steps : int
        The steps this worker trained on a batch of its own, and the steps it answered with a zero gradient after
        it ran out.
    """

    def __init__(self, device_params, ctx_list, reducer, lr=None, optimizer=None, net=lenet_cached,
                 loss=softmax_cross_entropy):
        self.optimizer = as_optimizer(lr, optimizer)
        self.reducer = as_reducer(reducer)
        self.replicas = DeviceReplicas(device_params, ctx_list, net, self.reducer)
        self.loss = loss
        self.steps = self.idle_steps = 0

    def __repr__(self):
        return f"Join({self.steps} steps, {self.idle_steps} idle)"

    def _counts(self, batch_size):
        """How many workers have a batch this step, and how many examples they hold together."""
        job = self.reducer.job
        if job is None:
            return (1 if batch_size else 0), batch_size
        workers, examples = sum_values(job, [1 if batch_size else 0, batch_size])
        return int(workers), int(examples)

    def train_batch(self, X, y):
        """One step on this worker's own batch ``X``, ``y`` (the others' batches summed in); returns the batch's
        summed loss, shape (1,) on the first context, not waited for. Blocks until every worker with a batch
        reached this step (the count of the step's examples)."""
        _, examples = self._counts(X.shape[0])
        self.steps += 1
        with across_workers(statistics_job(self.reducer.job)):
            return step_replicas(self.replicas, X, y, loss=self.loss, batch_size=examples, optimizer=self.optimizer,
                                 count_correct=False)[0]

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        """Out of batches: answer the others' steps with zero gradients until no worker has a batch. Not after an
        exception (the worker is failing; ``parallel.job.join`` ends it at once)."""
        if kind is not None:
            return False
        while True:
            workers, examples = self._counts(0)
            if workers == 0:
                return False
            with across_workers(statistics_job(self.reducer.job)):
                idle_step(self.replicas, examples, self.optimizer, count_correct=False)
            self.idle_steps += 1
