"""Context parallelism: each example's sequence split over a group of contexts, attention by ring attention
(Liu et al. 2023), data parallelism over the groups.

``ContextParallel(block, ctx_list, layout)`` cuts ``ctx_list`` into groups of C = ``layout.context`` consecutive
contexts. Each group takes a shard of the batch; every member of a group holds the whole model and the group's
examples, and keeps its slice of their tokens (member ``t`` the ``t``-th of C slices: the ViT's patch embedding
cuts them, ``ReplicasF.context_part``). Every layer but attention computes each token alone, so a member computes
its slice; attention runs round the group's ring (``parallel.models.ring``: the blocks of keys and values passed
from member to member, an online softmax). The class token is member 0's, so the group's logits are member 0's
head's. The members run in lockstep (``parallel.models.layers.run_replicas``, as expert parallelism does:
``parallel.strategies.experts``), one backward pass sends the gradients back round the ring, and every array's
gradient is summed over every context (all hold the whole model) by the Reducer.

Why ring attention and not DeepSpeed-Ulysses' all-to-all over heads: the ring splits any number of tokens over any
number of contexts (Ulysses needs the heads to divide: the ViT's 4 heads would cap C at 4), it is the one whose
online softmax the lesson shows, and each step talks to one neighbour only. Its cost: every key and value block
travels C - 1 hops a layer (``ring_bytes``), against Ulysses' two all-to-alls of the queries, keys and values and
one of the outputs, ``(C - 1) / C`` of them each.

>>> import mxnet as mx
>>> from parallel.layout import Layout
>>> from parallel.models.vit import init_vit
>>> model = ContextParallel(init_vit(seed=0, patch=4), [mx.cpu(0), mx.cpu(1)], Layout(context=2))
>>> model.describe()
"1 group of 2 contexts, each example's 50 tokens split over a group (25 a context), attention by ring attention; gradients summed with the fused allreduce in buckets of 25 MiB"
"""
from ..comm import algorithms
from ..validate import BadValue
from .experts import ExpertParallel

__all__ = ["ContextParallel"]


class ContextParallel(ExpertParallel):
    """A model whose attention is the ViT's (``parallel.models.vit.MultiHeadAttention``) trained with each example's
    tokens split over groups of ``layout.context`` contexts (see the module's docstring).

    Parameters
    ----------
    block : mxnet.gluon.HybridBlock
        The initialized ViT (``init_vit(patch=4)``: 50 tokens); copied, not modified.
    ctx_list : list of mxnet.Context
        A multiple of ``layout.context``.
    layout : parallel.Layout
        The data strategy with ``context`` (ZeRO 0 to 2, ``accumulate``, ``compression``).
    reducer : parallel.Reducer or str, optional
    """

    needs_experts = False

    def _check_layers(self, layers):
        if layers:
            raise BadValue("context", "{context} with a mixture of experts is not built; give one of them")
        if self.layout.stages_given > 1 or self.layout.tensor > 1 or self.layout.zero == 3:
            raise BadValue("layout", "ContextParallel runs the data strategy with ZeRO 0 to 2; pipeline stages, "
                                     "tensor ranks and ZeRO-3 are Hybrid's: use make_strategy")
        if len(self.ctx_list) % self.layout.context:
            raise BadValue("context", f"{{context={self.layout.context}}} cannot group {len(self.ctx_list)} "
                                      "contexts; use a multiple of it")

    def tokens(self):
        """The tokens of an example (the patch embedding's positions)."""
        return next(p for name, p in zip(self._names, self.dense[0]) if name.endswith("pos_embedding")).shape[1]

    def describe(self, accumulate=1):
        C, groups, n = self.context, len(self.in_ctx_list), self.tokens()
        bounds = algorithms.chunk_bounds(n, C)
        sizes = sorted({b - a for a, b in zip(bounds, bounds[1:])}, reverse=True)
        line = (f"{groups} group{'s' if groups > 1 else ''} of {C} contexts, each example's {n} tokens split over a "
                f"group ({' or '.join(map(str, sizes))} a context), attention by ring attention")
        return self._summed(line)
