"""Each model's parallelize plan (torchtitan's idea: one plan a model, which the strategy applies): what a layout
needs to know of a model that its mathematics does not say, kept out of the model files.

A model's code calls the seams of ``parallel.models.base``, and its ``F`` (a ``RanksF``) knows as it runs where the
tokens are split: sequence parallelism's *region* opens at ``split_tokens`` (the embedding's output) and closes at
``gather_tokens`` (the head's input); inside it the parallel layers' f and g are the all-gather and the
reduce-scatter of the sequence (``RanksF.in_region``). What a run cannot see, the plan says, from the children of
the region (listed by their class):

- which runs start inside the region (``inside``): a pipeline stage, or a block that recomputation or ZeRO-3 runs
  alone, that begins with a child of the region or with the child after it (the head): its input is each rank's
  slice of the tokens (``RankedNet(block, in_region=True)``);
- which arrays every rank of a tensor group holds whole but computes on its slice of the sequence (``summed``:
  the region's layer norms, row-parallel biases, a mixture of experts' router and experts): their gradients are
  partial on each rank and summed over the group (``parallel.strategies.Hybrid.finish_backward``).

A plan reads the model and writes nothing onto it. A new model with a sequence region adds its line to ``PLANS``
(and ``sequences=True`` to its entry of ``parallel.models.MODELS``); its file stays mathematics.

>>> from parallel.models.vit import init_vit
>>> net = init_vit()
>>> plan = plan_of(net)
>>> plan, plan.region(net), len(plan.summed(net))
(Plan(blocks=(TransformerBlock,)), [1, 2, 3, 4], 24)
>>> sorted({name.split("_")[1] for name in plan.inside(net)})   # the blocks' arrays and the head's
['classifierhead0', 'transformerblock0', 'transformerblock1', 'transformerblock2', 'transformerblock3']
>>> plan_of(mx.gluon.nn.HybridSequential()).region(init_vit())
[]
"""
from typing import NamedTuple

import mxnet as mx

from ..shard import Replicated
from .layers import shard_specs
from .transformer import PostNormBlock
from .vit import TransformerBlock

__all__ = ["Plan", "PLANS", "plan_of"]


class Plan(NamedTuple):
    """A model's parallelize plan: ``blocks``, the classes of the children its sequence region holds (none: the
    model has no region, and sequence parallelism is refused)."""
    blocks: tuple = ()

    def __repr__(self):
        return f"Plan(blocks=({''.join(f'{cls.__name__},' for cls in self.blocks)}))"

    def region(self, net):
        """The positions of ``net``'s children in the region (``net`` a gluon ``HybridSequential``; none for another
        block)."""
        children = list(net) if isinstance(net, mx.gluon.nn.HybridSequential) else []
        return [i for i, child in enumerate(children) if self.blocks and isinstance(child, self.blocks)]

    def summed(self, net):
        """The names of the trained arrays of the region's children that every tensor rank holds whole
        (``Replicated``): computed on each rank's slice of the sequence, their gradients summed over the ranks."""
        specs = shard_specs(net)
        return [param.name for i in self.region(net) for param in net[i].collect_params().values()
                if param.grad_req != "null" and isinstance(specs.get(param.name), Replicated)]

    def inside(self, net):
        """The names of the trained arrays of the children whose input is each rank's slice of the tokens (the
        region's, and the one after it, which gathers them): a run whose first array is one of them starts inside
        the region."""
        region = set(self.region(net))
        starts = sorted(region | {i + 1 for i in region if i + 1 < len(net)})
        return {param.name for i in starts for param in net[i].collect_params().values() if param.grad_req != "null"}


#: The plans of the models of ``parallel.models.MODELS`` that have a sequence region, by name.
PLANS = {
    "vit": Plan((TransformerBlock,)),
    "transformer": Plan((PostNormBlock,)),
}


def plan_of(net):
    """The plan of the model ``net`` is (the one whose region holds some of its children), or ``Plan()`` (no region)
    for a block of no model of ``PLANS``."""
    return next((plan for plan in PLANS.values() if plan.region(net)), Plan())
