"""The strategy protocol: what every strategy is and does, with its documented defaults, and the one way a
strategy's arrays are read whole and written back, whatever their layout.

A strategy (``make_strategy``'s result) is a ``Strategy``: the training loop (``parallel.fit``), the checkpoints,
the report and the CLI use these members and nothing else; nobody asks a strategy whether it has a member.

- ``name`` (the layout's preset: ``"data"``, ``"model"``, ``"pipeline"``, ``"hybrid"``), ``layout`` (a
  ``parallel.layout.Layout``), ``ctx_list`` (the contexts it computes on), ``reducer`` (the ``parallel.comm.Reducer``
  of every data-parallel sum) and ``job`` (the reducer's: None in one process);
- ``train_step(X, y, lr=None, loss=..., optimizer=None, accumulate=1)`` -> (summed loss, correct count): one step
  of ``parallel.step.step_replicas``, ``evaluate(data_iter)`` -> accuracy, ``describe(accumulate)`` -> one line;
- ``groups()``: the trained arrays as ``parallel.optim.optimizer_step`` takes them (where the optimizer's state
  lives, what ``memory_table`` measures);
- ``places()``: where each of the model's trained arrays lies (``ArrayPlace``: the store of each tensor rank, the
  array's index there, its tensor-parallel ``parallel.shard`` spec). From it, written once here: ``params()`` (the
  model's arrays whole, in its order), ``lazy_params()`` (the same, each gathered when read: a checkpoint holds one
  at a time), ``gather_state(optimizer)`` and ``load_state(optimizer, state)`` (the optimizer's state whole, and
  laid out again on any layout);
- defaults a strategy may override: ``aux()`` / ``names()`` / ``aux_names()`` (none), ``model`` (what ``fit``
  returns: the strategy), ``gathers_collectively`` (False: reading the model is a collective call in a job only for
  ZeRO-3), ``memory_buffers()`` (no gather or temporary buffers of its own), ``metrics()`` (nothing for
  ``--metrics-json``), ``epoch_metrics()`` (nothing measured while training), ``feedback_groups()`` (the groups whose error feedback a checkpoint keeps: every group, with
  compression).

A *store* holds one group's arrays over the data axis: ``parallel.optim.ReplicatedStore`` for replicas of the same parameters
(ZeRO 0-2: the state whole on each, or each replica's regions), ``parallel.strategies.sharded.ShardedGroup`` for
ZeRO-3's chunks. It reads one array of the group whole (the parameters, or a state buffer) and writes them all.
"""
import abc
import functools
from typing import NamedTuple

import mxnet as mx

from ..export import LazyArrays
from ..optim.zero import ReplicatedStore
from ..shard import Replicated

__all__ = ["Strategy", "ArrayPlace"]


class ArrayPlace(NamedTuple):
    """Where one of the model's trained arrays lies: ``stores[t]``, tensor rank ``t``'s store, holds its part as
    array ``index`` of the group; ``spec`` (``parallel.shard``) says how the ranks' parts make the whole, of
    ``shape``."""
    stores: list
    index: int
    spec: object = Replicated()
    shape: tuple = None


class Strategy(abc.ABC):
    """A laid-out model and the step it trains with (see the module's docstring)."""

    #: The layout's preset, what the epoch lines and the report call the strategy.
    name = "data"
    #: Whether reading the model (``params``, ``gather_state``) is a collective call: in a job every worker must
    #: make it, also those that do not use the result (ZeRO-3's gathers).
    gathers_collectively = False

    @property
    def job(self):
        """The distributed job this strategy trains in (its reducer's), or None."""
        return self.reducer.job

    @property
    def model(self):
        """What ``fit`` returns: the strategy itself."""
        return self

    @abc.abstractmethod
    def train_step(self, X, y, lr=None, loss=None, optimizer=None, accumulate=1):
        """One optimizer step on the batch; returns (summed loss, correct count), each (1,), not waited for."""

    @abc.abstractmethod
    def evaluate(self, data_iter):
        """Accuracy over ``data_iter``."""

    @abc.abstractmethod
    def groups(self):
        """The trained arrays as groups of replicas of the same parameters (``optimizer_step``'s)."""

    @abc.abstractmethod
    def describe(self, accumulate=1):
        """One line: how the model is laid out and summed."""

    @abc.abstractmethod
    def places(self):
        """An ``ArrayPlace`` for each of the model's trained arrays, in the model's order."""

    def aux(self):
        """The model's arrays that are not trained (BatchNorm's running statistics), in its order: none."""
        return []

    def names(self):
        """The model's trained arrays' names, in ``params()`` order (``[]``: LeNet's, which has fixed names)."""
        return []

    def aux_names(self):
        """The names of ``aux()``'s arrays."""
        return []

    def memory_buffers(self):
        """``(gathered, temporary)``: ``{context: bytes}`` of full parameters gathered at once (ZeRO-3) and of the
        strategy's own temporary buffers; none by default."""
        return {}, {}

    def metrics(self):
        """What ``--metrics-json`` records of the strategy beside the epochs (a pipeline's schedule): nothing."""
        return {}

    def activations(self):
        """``{context: {"replicated": bytes, "total": bytes}}``: what the last step's forward kept for backward, as
        far as the strategy measures it (tensor ranks': ``Hybrid.activations``); nothing by default."""
        return {}

    def count_activations(self, counting):
        """Whether the next steps count what ``activations`` reads (a strategy that measures none ignores it);
        returns the setting before. ``fit`` counts only each epoch's last step, the one its memory table reads."""
        return False

    def epoch_metrics(self):
        """What the strategy measured over the steps since the last call (an epoch's: ``fit`` calls it after each
        epoch and records it in the epoch's metrics, ``--metrics-json``'s): nothing by default; a mixture of
        experts' routing (``Hybrid``)."""
        return {}

    def feedback_groups(self):
        """The groups whose reducer keeps error feedback (a codec's residuals), which a checkpoint stores: every
        group when the reducer compresses, else none."""
        return self.groups() if self.reducer.codec is not None else []

    # ---- the model's arrays whole, and back (written once, from ``places``) ------------------------------------

    def array(self, j, state=-1, optimizer=None):
        """The model's trained array ``j`` whole: its parameters (``state`` -1) or state buffer ``state`` of
        ``optimizer``; each tensor rank's part read from its store and put together by its spec."""
        place = self.places()[j]
        parts = [store.read(optimizer, state, place.index, (j, state)) for store in place.stores]
        return place.spec.join(parts, place.shape)

    def params(self):
        """The model's trained arrays, whole, in its order (live where one context holds an array whole)."""
        return [self.array(j) for j in range(len(self.places()))]

    def lazy_params(self):
        """``params()`` as ``LazyArrays``: each array gathered when read (a checkpoint holds one at a time)."""
        return LazyArrays(len(self.places()), self.array)

    def gather_state(self, optimizer):
        """The optimizer's state as a checkpoint stores it: ``{state name: LazyArrays}``, item ``j`` state of the
        model's array ``j``, whole on the CPU when read (zeros where it has not stepped yet); ``{}`` for a
        stateless optimizer."""
        n = len(self.places())
        return {name: LazyArrays(n, functools.partial(_state_array, self, k, optimizer))
                for k, name in enumerate(optimizer.state_names())}

    def load_state(self, optimizer, state):
        """Give ``optimizer`` the state ``state`` (``gather_state``'s form, from any layout), each store its
        part."""
        names = optimizer.state_names()
        if sorted(state) != sorted(names):
            raise ValueError(f"state holds {sorted(state)} but {optimizer.name} keeps {list(names)}")
        places = self.places()
        for name in names:
            if len(state[name]) != len(places):
                raise ValueError(f"state[{name!r}] holds {len(state[name])} arrays, the model {len(places)}")
        for k, name in enumerate(names):
            for store, arrays in _per_store(places, [state[name][j] for j in range(len(places))]).items():
                store.write(optimizer, k, arrays)


def _state_array(strategy, k, optimizer, j):
    return strategy.array(j, k, optimizer)


def _per_store(places, whole):
    """Each store's arrays (its order) cut from the model's arrays ``whole`` by their specs."""
    per_store = {}
    for place, array in zip(places, whole):
        array = array if isinstance(array, mx.nd.NDArray) else mx.nd.array(array, dtype=array.dtype)
        for t, store in enumerate(place.stores):
            per_store.setdefault(store, {})[place.index] = place.spec.local(array, t, len(place.stores))
    return {store: [parts[i] for i in range(len(parts))] for store, parts in per_store.items()}
