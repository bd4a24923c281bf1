"""Error feedback in a checkpoint: every worker's residuals (and PowerSGD's ``Q`` matrices), named by worker and
context, and how a run on the same layout or another one takes them back.

A compressor's ``state(buffers, across)`` names its arrays by where they live in one process
(``"residual/c1"``, ``"residual/across"``, ``"query/c0/3"``); a checkpoint holds every worker's, under
``"w<rank>/"`` (``"w1/residual/c0"``). ``place`` hands a worker its part:

- on the layout that saved them (the same number of workers, each with the same contexts), each worker gets its
  own arrays back: the resumed run continues bitwise;
- on another layout, nothing is lost either: the sum of every residual (what no worker has sent yet) goes to
  worker 0's first context (or, with one context a worker, to worker 0's cross-worker residual), to be added to
  its next gradient, and worker 0's ``Q`` matrices warm-start every context and worker. The one layout that
  cannot take residuals is a single context in a single process: nothing is compressed there, so they are
  dropped (``place`` says so).

>>> import numpy as np
>>> saved = {"w0/residual/c0": np.ones(3), "w0/residual/c1": np.full(3, 2.0)}
>>> sorted(place(saved, rank=0, num_workers=1, num_contexts=2)[0])          # the same layout: its own arrays
['residual/c0', 'residual/c1']
>>> local, note = place(saved, rank=0, num_workers=1, num_contexts=3)       # another: the sum on context 0
>>> {name: value.tolist() for name, value in local.items()}, note
({'residual/c0': [3.0, 3.0, 3.0]}, None)
"""
import numpy as np

__all__ = ["job_names", "split_name", "place", "expected_residuals"]


def split_name(name):
    """``(rank, local name)`` of a checkpoint's ``"w<rank>/<name>"``, or None for a name not of that form."""
    worker, _, local = name.partition("/") if isinstance(name, str) else ("", "", "")
    return (int(worker[1:]), local) if worker[:1] == "w" and worker[1:].isdigit() and local else None


def job_names(rank, state):
    """A worker's ``state`` under the names a checkpoint gives it (``"w<rank>/..."``)."""
    return {f"w{rank}/{name}": value for name, value in state.items()}


def expected_residuals(num_workers, num_contexts, num_groups=1):
    """The residuals one worker keeps on this layout once it has stepped: one a context when there are
    several (the compressed allreduce between them), one across the workers in a job of several; each under
    ``"g<group>/"`` when the layout sums several groups (a stage's or a tensor rank's replicas each)."""
    names = {f"residual/c{k}" for k in range(num_contexts)} if num_contexts > 1 else set()
    names |= {"residual/across"} if num_workers > 1 else set()
    return names if num_groups == 1 else {f"g{g}/{name}" for g in range(num_groups) for name in names}


def place(saved, rank, num_workers, num_contexts, num_groups=1):
    """Worker ``rank``'s share of a checkpoint's error-feedback state ``saved`` (``"w<r>/..."`` names, as
    ``job_names`` gives them) for a run of ``num_workers`` workers of ``num_contexts`` contexts each, summing
    ``num_groups`` groups of replicas (their state named ``"g<group>/..."`` when several).

    Returns ``(state, note)``: the state for ``Codec.load_state`` (``Reducer.load_state``) (numpy arrays), and None, or a sentence
    saying that residuals were dropped (a single context in a single process compresses nothing; the residuals of
    a layout of several groups, whose buffers are parts of the model, fit only the same layout).
    """
    workers = {}
    for name, value in saved.items():
        split = split_name(name)
        if split is None:
            raise ValueError(f"compression_state: {name!r} is not named w<rank>/<name>; pass a checkpoint's "
                             "compression_state")
        workers.setdefault(split[0], {})[split[1]] = np.asarray(value.asnumpy() if hasattr(value, "asnumpy")
                                                                else value)
    if not workers:
        return {}, None
    expected = expected_residuals(num_workers, num_contexts, num_groups)
    if sorted(workers) == list(range(num_workers)) and all(
            {name for name in state if "residual/" in name} == expected for state in workers.values()):
        return workers[rank], None                      # the layout that saved them: bitwise
    if num_groups > 1 or any(name.startswith("g") for state in workers.values() for name in state):
        return {}, ("the checkpoint's compression residuals were dropped: they belong to the buffers of another "
                    "layout's groups of replicas (stages, tensor ranks), which this layout does not have")
    local = {}
    residuals = [state[name] for _, state in sorted(workers.items()) for name in sorted(state)
                 if name.startswith("residual/")]
    target = "residual/c0" if num_contexts > 1 else "residual/across" if num_workers > 1 else None
    note = None
    if residuals and rank == 0:
        if target is None:
            note = ("the checkpoint's compression residuals were dropped: one context in one process compresses "
                    "nothing, so there is no gradient to add them to")
        else:
            local[target] = np.sum(residuals, axis=0, dtype=residuals[0].dtype)
    first = workers[min(workers)]
    tensors = sorted({int(name.rsplit("/", 1)[1]) for name in first if name.startswith("query/")})
    for t in tensors:
        source = next(first[name] for name in sorted(first) if name.startswith("query/") and
                      name.endswith(f"/{t}"))
        for where in [f"c{k}" for k in range(num_contexts)] + (["across"] if num_workers > 1 else []):
            local[f"query/{where}/{t}"] = source
    return local, note
