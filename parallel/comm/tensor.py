"""Megatron's conjugate operators f and g (Shoeybi et al. 2019), written from scratch for the T ranks of a
tensor-parallel group (one array a rank, each on its own context, in rank order), and the tape that runs a
group's backward pass through them.

- ``f`` (``TensorTape.f``): forward, the identity (every rank already holds the same input); backward, the
  allreduce of the ranks' gradients. A column-parallel layer after it sends back only its own rows' part of the
  input's gradient, and the sum over the ranks is the whole.
- ``g`` (``TensorTape.g``): forward, the allreduce of the ranks' partial outputs (a row-parallel layer's);
  backward, the identity: each rank's partial output gets the gradient of the sum.

A Transformer block costs one f and one g in its attention and one of each in its MLP: two allreduces of its
activations forward, two backward (Megatron's four a layer a step). The sums are the package's allreduce
(``algorithms.allreduce``, ``fused`` by default), which leaves the same bits on every rank, so what the ranks
compute from them (layer norms, the residual stream) stays identical on every rank.

Why a tape and not ``autograd.Function``s. A ``Function`` is one node of MXNet's graph on one context: MXNet 1.9.1
hands its backward the output gradients on the default context (``cpu(0)``, measured: even for a ``Function``
whose arrays are all on ``cpu(1)``), and a collective's backward needs every rank's gradient at once, which one
rank's node never sees (waiting for the others inside it would block that context's engine thread). So f and g
are steps of their own: ``TensorTape`` records the group's forward a *segment* at a time (each rank's work between
two collectives, run under ``autograd.record()`` on inputs detached from what came before, with gradients
attached), and ``backward()`` runs the segments' backward passes last first, applying f's and g's backward
between them. Each segment runs the same operators on the same values as the unsegmented graph.

>>> import mxnet as mx
>>> from mxnet import autograd
>>> tape = TensorTape()
>>> xs = [mx.nd.array([1.0, 2.0], ctx=mx.cpu(0)), mx.nd.array([3.0, 4.0], ctx=mx.cpu(1))]
>>> for x in xs:
...     x.attach_grad()
>>> with autograd.record():
...     summed = tape.g(tape.run(lambda t, x: 2 * x, xs))   # g's forward: the sum, on every rank
...     loss = tape.run(lambda t, s: (s * s).sum(), summed)
>>> summed[1].asnumpy().tolist()
[8.0, 12.0]
>>> tape.backward(loss)   # d loss_1 / d x_1 = 2 * 2 * (x_0 + x_1): g passes the gradient of the sum on
>>> xs[1].grad.asnumpy().tolist()
[32.0, 48.0]
"""
import mxnet as mx
from mxnet import autograd

from . import algorithms

__all__ = ["TensorTape"]


def _arrays(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


class TensorTape:
    """A tensor-parallel group's forward pass, recorded a segment at a time, and its backward pass through f and g
    (see the module's docstring).

    Parameters
    ----------
    algorithm : str
        The allreduce of f's backward and g's forward (``parallel.comm.ALGORITHMS``).

    Attributes
    ----------
    allreduced : int
        Elements f and g have summed so far (forward and backward, each rank's array counted once): what a step's
        collectives move, for ``bytes_moved``.

    Outside ``autograd.record()`` (evaluation) nothing is kept: ``run``, ``f`` and ``g`` compute the forward pass
    alone.
    """

    def __init__(self, algorithm="fused"):
        self.algorithm = algorithm
        self.allreduced = 0
        self._clear()

    def _clear(self):
        self._steps = []    # what backward undoes, last first: (kind, sources, outputs)
        self._made = {}     # id(array a step made) -> the array (kept: its id stays its own)
        self._leaves = {}   # id(array a step made) -> the leaf through which later steps read it

    def _read(self, array):
        """``array`` as a later step reads it: through its leaf (detached, gradient attached and added to) if a step
        of this tape made it, else as it is (an input from outside: no gradient comes back to it)."""
        if id(array) not in self._made:
            return array
        leaf = self._leaves.get(id(array))
        if leaf is None:
            leaf = self._leaves[id(array)] = array.detach()
            leaf.attach_grad(grad_req="add")
        return leaf

    def _keep(self, kind, sources, outputs):
        self._steps.append((kind, sources, outputs))
        self._made.update((id(a), a) for a in outputs)

    def run(self, fn, *inputs):
        """``fn(t, *inputs_t)`` on each rank ``t``: ``inputs`` are lists of one value a rank (an array or a tuple of
        arrays); returns the list of the ranks' results (an array or a tuple each). Recording, the arrays a step of
        this tape made are read through their leaves."""
        if not autograd.is_recording():
            return [fn(t, *[values[t] for values in inputs]) for t in range(len(inputs[0]))]
        outputs = []
        for t in range(len(inputs[0])):
            args = [tuple(map(self._read, v)) if isinstance(v, (list, tuple)) else self._read(v)
                    for v in (values[t] for values in inputs)]
            outputs.append(fn(t, *args))
        self._keep("run", None, [a for out in outputs for a in _arrays(out)])
        return outputs

    def f(self, xs):
        """Megatron's f on ``xs`` (one array a rank): the same arrays forward, their gradients allreduced
        backward."""
        if not autograd.is_recording():
            return list(xs)
        sources = [self._read(x) for x in xs]
        outputs = [x.detach() for x in sources]
        self._keep("f", sources, outputs)
        return outputs

    def g(self, xs):
        """Megatron's g on ``xs`` (one partial sum a rank): their sum on every rank forward, the gradient passed
        through backward."""
        outputs = [x.detach().copy() for x in xs]
        algorithms.allreduce(outputs, self.algorithm)
        self.allreduced += sum(x.size for x in xs)
        if autograd.is_recording():
            self._keep("g", [self._read(x) for x in xs], outputs)
        return outputs

    def backward(self, heads=None, head_grads=None):
        """The backward pass of what the tape recorded: ``autograd.backward(heads, head_grads)`` first (what came
        after the tape's steps: the loss), then each step, last first, from the gradients its outputs' readers
        left on their leaves. Nothing waits."""
        if heads is not None:
            autograd.backward(_arrays(heads), head_grads)
        for kind, sources, outputs in reversed(self._steps):
            leaves = [self._leaves.get(id(a)) for a in outputs]
            if kind == "run":
                read = [(a, leaf.grad) for a, leaf in zip(outputs, leaves) if leaf is not None]
                if read:
                    autograd.backward([a for a, _ in read], [grad for _, grad in read])
                continue
            if any(leaf is None for leaf in leaves):
                continue
            grads = [leaf.grad for leaf in leaves]
            if kind == "f":   # the allreduce of the ranks' gradients
                grads = [grad.copy() for grad in grads]
                algorithms.allreduce(grads, self.algorithm)
                self.allreduced += sum(grad.size for grad in grads)
            for source, grad in zip(sources, grads):   # g: the identity
                if source.grad is not None:
                    source.grad[:] += grad
        self._clear()
