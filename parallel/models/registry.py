"""What each model does, one class per kind: the behaviour that ``MODELS[name].behaviour`` reaches.

``parallel.models.MODELS`` names the models without MXNet; each entry's ``behaviour`` is an instance of a class
here, imported on first use. It is the one place that knows a model: the rest of the package asks it, never
``model == "lenet"``. Every kind answers the same methods:

- ``init(seed, params=None, aux=None)``: the initial model, as ``make_strategy`` takes it;
- ``layout()``: the names and shapes of its arrays, as a checkpoint stores them (``Layout``);
- ``check(params, aux)``: those arrays checked (count, shapes, finite) and copied to the host, by name;
  ``thunks(params, aux)`` the same checks as one function per name, each reading, checking and copying its
  array when called (a checkpoint written one array at a time);
- ``net(initial)``: the function ``net(X, params)`` data parallelism runs on each replica;
- ``layers(initial)`` and ``cut(initial, ranges)``: what model and pipeline parallelism cut, and the stages;
- ``segments(initial)``: the blocks activation recomputation keeps the input of (``parallel.models.recompute``);
  ``units(initial)`` the finer ones ZeRO-3 gathers one at a time (a residual block in its two halves);
- ``export(prefix, params, aux, initial)``: the trained arrays as MXNet's symbol + params pair;
- ``shard_specs(initial)``: how tensor parallelism lays out each trainable array over a group's ranks
  (``parallel.shard``): the specs the parallel layers of a gluon model declare, ``Replicated()`` for the others
  (every array of LeNet and ResNet-18, which hold no parallel layer).

A strategy is handed the initial model itself, not its name: ``behaviour_of(initial)`` gives the behaviour
of LeNet's arrays or of any gluon block.

>>> from parallel.models import MODELS
>>> lenet = MODELS["lenet"].behaviour
>>> lenet.layout().names[:2], lenet.layers(lenet.init(seed=0))
(('conv1_weight', 'conv1_bias'), Layers(count=4, what="LeNet's 4 layers", unit='layer'))
"""
import functools
from collections.abc import Sequence
from typing import List, NamedTuple

import mxnet as mx
from mxnet import gluon

from ..comm.replica import block_state
from ..export import array_thunks, export_gluon, export_lenet, lenet_thunks
from ..mxnet_compat import structural_params
from ..shard import Replicated
from . import MODELS
from .base import Cuttable
from .gluon import Chain, GluonNet, as_net
from .layers import shard_specs
from .layout import Layout, block_names
from .lenet import (LENET_LAYERS, LENET_PARAM_NAMES, LENET_SHAPES, CachedNet, LenetStage, init_lenet_params,
                    lenet_cached, lenet_layers)
from .recompute import Segment
from .resnet import init_resnet18, resnet18
from .moe import Experts, moe_layers
from .transformer import init_transformer, transformer
from .plan import Plan, plan_of
from .vit import init_vit, vit

__all__ = ["Layers", "Cut", "Model", "LeNetModel", "GluonModel", "BuiltGluonModel", "ResNet18Model",
           "ExpertsVariants", "ViTModel", "TransformerModel", "behaviour_of"]


class Layers(NamedTuple):
    """What a model is cut at, as ``parallel.strategies.stage_ranges`` takes it."""
    #: How many layers (children) there are.
    count: int
    #: How messages name them all ("LeNet's 4 layers") and one of them ("layer").
    what: str
    unit: str


class Cut(NamedTuple):
    """A model cut into stages, not yet placed on contexts."""
    #: ``(start, stop)``: the layers of each stage.
    ranges: List[tuple]
    #: What ``get_params`` copies to stage ``s``'s context.
    sources: list
    #: ``nets[s](X, params)`` runs stage ``s``.
    nets: list
    #: How ``describe()`` names each stage ("conv1,conv2", "children 0-2").
    labels: List[str]
    #: The trainable arrays' names and the others', in the model's order; both empty when the stages' arrays, one
    #: after the other, are the model's in its order (LeNet).
    names: List[str]
    aux_names: List[str]


class Model:
    """The behaviour of a kind of model; ``title`` is how messages name it. A kind that cannot do something
    (a gluon block that is not a model of ``MODELS`` has no initial values of its own) raises
    ``NotImplementedError``."""

    def __init__(self, title):
        self.title = title

    def __repr__(self):
        return f"{type(self).__name__}({self.title!r})"

    def _lacks(self, what):
        return NotImplementedError(f"{self.title} has no {what}; use a model of MODELS ({', '.join(MODELS)})")

    def init(self, seed=0, params=None, aux=None):
        """The initial model of a run, as ``make_strategy`` takes it (see ``parallel.models.init_model``)."""
        raise self._lacks("initial values of its own")

    def layout(self):
        """The ``Layout`` of its arrays: their names and shapes, as a checkpoint stores them."""
        raise self._lacks("fixed layout")

    def check(self, params, aux=()):
        """``params`` and ``aux`` (in ``layout()`` order) checked and copied to the host, by name.

        Returns
        -------
        dict
            ``{name: numpy array}``, trainable arrays first, in ``layout()`` order.

        Raises
        ------
        TypeError, ValueError
            For arrays that are not the model's (count, shape, dtype) or not finite (``check_arrays``).
        """
        return {name: thunk() for name, thunk in self.thunks(params, aux).items()}

    def thunks(self, params, aux=()):
        """``check``'s checks, one function per name: the count of ``params`` and ``aux`` (lists, tuples or
        ``LazyArrays``) is checked at once, and each function reads its array (once per call), checks it and
        returns a numpy copy (``array_thunks``).

        Returns
        -------
        dict
            ``{name: function of no argument}``, trainable arrays first, in ``layout()`` order.

        Raises
        ------
        TypeError, ValueError
            For containers that are not the model's (type, count); the functions raise what ``check`` raises.
        """
        raise self._lacks("fixed layout")

    def net(self, initial):
        """The function ``net(X, params)`` that runs ``initial`` on each replica (data parallelism)."""
        raise NotImplementedError

    def layers(self, initial):
        """The ``Layers`` that ``initial`` is cut at; raises ``TypeError`` or ``ValueError`` for a model it
        cannot cut."""
        raise NotImplementedError

    def cut(self, initial, ranges):
        """``initial`` cut into stages of ``ranges`` (``stage_ranges`` of ``layers(initial)``): a ``Cut``."""
        raise NotImplementedError

    def segments(self, initial):
        """The blocks of ``initial`` that activation recomputation keeps the input of, in order: a list of
        ``Segment`` (each a cached graph of the block on its arrays of a replica)."""
        raise NotImplementedError

    def units(self, initial):
        """The blocks ZeRO-3 gathers one at a time (and recomputes): ``segments``, cut finer where the model can be
        (a ``Segment`` of several inputs takes the tuple the one before returns)."""
        return self.segments(initial)

    def stage_blocks(self, cut, c, fine=False):
        """Stage ``c`` of ``cut`` (``cut(initial, ranges)``) as the blocks recomputation keeps the inputs of
        (``fine``: the finer blocks ZeRO-3 gathers one at a time): ``Segment``s over the stage's arrays."""
        raise NotImplementedError

    def export(self, prefix, params, aux=(), initial=None):
        """Write the trained ``params`` and ``aux`` (a strategy's ``params()`` and ``aux()``) as MXNet's pair
        ``PREFIX-symbol.json`` + ``PREFIX-0000.params``; ``initial`` is the model the run started from.

        Returns
        -------
        (str, str)
            The paths of the symbol file and of the params file.
        """
        raise NotImplementedError

    def plan(self, initial):
        """The parallelize plan of ``initial`` (``parallel.models.plan.Plan``): where layouts split its tokens; by
        default none (no sequence region)."""
        return Plan()

    def shard_specs(self, initial):
        """How tensor parallelism lays out each trainable array of ``initial`` over a group's ranks:
        ``{name: spec}`` (``parallel.shard``), in the model's order. A model without parallel layers gives every
        array ``Replicated()``: on T ranks it runs as T copies of itself (correct, and nothing saved)."""
        raise NotImplementedError


def _has_children(block):
    """Whether the gluon ``block`` holds blocks of its own (``Block.apply`` visits them, then the block)."""
    seen = []
    block.apply(seen.append)
    return len(seen) > 1


class LeNetModel(Model):
    """The from-scratch LeNet: eight arrays (``LENET_SHAPES``), run by ``lenet_cached``, cut between the layers
    of ``LENET_LAYERS``, exported with ``export_lenet``."""

    def _no_aux(self, aux):
        if aux is None:
            count = 0
        else:   # a sequence's length reads none of its arrays (a LazyArrays computes them when read)
            count = len(aux) if isinstance(aux, Sequence) else len(list(aux))
        if count:
            raise ValueError(f"{self.title} has no arrays besides its parameters, got {count} aux arrays")

    def init(self, seed=0, params=None, aux=None):
        self._no_aux(aux)
        return init_lenet_params(seed) if params is None else list(params)

    def layout(self):
        return Layout(tuple(LENET_PARAM_NAMES), tuple(LENET_SHAPES), (), ())

    def thunks(self, params, aux=()):
        self._no_aux(aux)
        return dict(zip(LENET_PARAM_NAMES, lenet_thunks(params)))

    def net(self, initial):
        return lenet_cached

    def layers(self, initial):
        if not isinstance(initial, (list, tuple)):
            raise TypeError(f"model must be LeNet's list of parameters (init_lenet_params) or an initialized "
                            f"gluon HybridSequential, got {type(initial).__name__}")
        if len(initial) != len(LENET_SHAPES):
            raise ValueError(f"params has {len(initial)} arrays but LeNet takes {len(LENET_SHAPES)}; "
                             "use init_lenet_params")
        return Layers(len(LENET_LAYERS), f"{self.title}'s {len(LENET_LAYERS)} layers", "layer")

    def cut(self, initial, ranges):
        # layer i owns params[2*i:2*i+2]: the stages' arrays, one after the other, are LeNet's in order
        # the whole network in one stage (the data preset) runs as lenet_cached, the cached graph DataParallel runs
        whole = (0, len(LENET_LAYERS))
        return Cut(ranges, [list(initial[2 * start:2 * stop]) for start, stop in ranges],
                   [lenet_cached if (start, stop) == whole else LenetStage(start, stop) for start, stop in ranges],
                   [",".join(name for name, _ in LENET_LAYERS[start:stop]) for start, stop in ranges], [], [])

    def segments(self, initial):
        self.layers(initial)
        return _lenet_segments()

    def stage_blocks(self, cut, c, fine=False):
        start, stop = cut.ranges[c]
        return [Segment(segment.net, segment.first - 2 * start, segment.stop - 2 * start, label=segment.label)
                for segment in _lenet_segments()[start:stop]]

    def export(self, prefix, params, aux=(), initial=None):
        self._no_aux(aux)
        return export_lenet(params, prefix)

    def shard_specs(self, initial):
        """Every one of LeNet's eight arrays ``Replicated()``, by its name (it has no parallel layer)."""
        self.layers(initial)
        return {name: Replicated() for name in LENET_PARAM_NAMES}


def _graph(block, **options):
    """``GluonNet(block, **options)``, or None for a block with mixture-of-experts layers: they route on the host
    and have no graph; a strategy runs such a block in lockstep (``parallel.models.lockstep``) instead."""
    return None if moe_layers(block) else GluonNet(block, **options)


@functools.lru_cache(maxsize=None)
def _lenet_segments():
    """LeNet's layers as blocks: layer ``i`` a cached graph of its two arrays (made once, kept)."""
    return [Segment(CachedNet(functools.partial(lenet_layers, start=i, stop=i + 1), static=False), 2 * i, 2 * i + 2,
                    label=name)
            for i, (name, _) in enumerate(LENET_LAYERS)]


class GluonModel(Model):
    """Any initialized gluon ``HybridSequential`` with known shapes: run as its ``GluonNet``, cut at its
    children (stage ``s`` a ``HybridSequential`` of them), exported with gluon's own ``export``."""

    def net(self, initial):
        return as_net(initial)

    def layers(self, initial):
        if not isinstance(initial, gluon.nn.HybridSequential):
            raise TypeError(f"a gluon model is cut at its children, so it must be a gluon HybridSequential, got "
                            f"{type(initial).__name__}; put its parts in an nn.HybridSequential")
        if len(initial) == 0:
            raise ValueError("the HybridSequential has no children to cut into stages; add its layers first")
        block_state(initial)   # ValueError while shapes are unknown
        return Layers(len(initial), f"the block's {len(initial)} children", "child")

    def cut(self, initial, ranges):
        names, _, aux_names, _ = block_state(initial)
        sources = []
        for s, (start, stop) in enumerate(ranges):
            # An explicit prefix: no new name is drawn from gluon's global counters. The children are
            # shared with ``initial``, not copied; their parameter names are the block's own.
            stage = gluon.nn.HybridSequential(prefix=f"{initial.prefix}stage{s}_")
            for i in range(start, stop):
                stage.add(initial[i])
            sources.append(stage)
        labels = [f"{start}" if stop - start == 1 else f"{start}-{stop - 1}" for start, stop in ranges]
        labels[0] = f"children {labels[0]}"
        return Cut(ranges, sources, [_graph(stage) for stage in sources], labels, names, aux_names)

    def segments(self, initial):
        """A child made of blocks that have children of their own (a stage of residual blocks) gives each of
        them as a block; any other child is a block itself; a child without trained arrays (pooling) joins the
        block after it (the last ones, the block before)."""
        return self._chain(initial, self._children(initial))

    def units(self, initial):
        """``segments``, each block that says how to cut it (a ``Cuttable``'s ``parts()``: a residual block's two
        halves) cut so."""
        units = []
        for child in self._children(initial):
            units.extend(child.parts() if isinstance(child, Cuttable) else [child])
        return self._chain(initial, units)

    def stage_blocks(self, cut, c, fine=False):
        """A stage of trained arrays cut into its blocks (``segments``, or with ``fine`` ``units``); a stage without
        any (pooling alone) is one block, the stage's own net."""
        stage = cut.sources[c]
        if not block_state(stage)[1]:
            return [Segment(cut.nets[c], 0, 0, 0, len(block_state(stage)[3]), label=cut.labels[c], block=stage)]
        return self.units(stage) if fine else self.segments(stage)

    def _children(self, initial):
        self.layers(initial)
        children = []
        for child in initial:
            inner = list(child) if isinstance(child, gluon.nn.HybridSequential) else []
            children.extend(inner if inner and all(_has_children(c) for c in inner) else [child])
        return children

    @staticmethod
    def _chain(initial, children):
        """``children`` (blocks run one after the other) grouped into ``Segment``s: a child without trained arrays
        joins the group after it (the last ones, the group before); a group takes its first child's inputs."""
        groups, pending = [], []
        for child in children:
            pending.append(child)
            if block_state(child)[1]:
                groups.append(pending)
                pending = []
        if pending:
            if not groups:
                raise ValueError("the block has no trained arrays to recompute the gradients of")
            groups[-1].extend(pending)
        segments, first, aux_first = [], 0, 0
        for g, group in enumerate(groups):
            block = Chain(group, prefix=f"{initial.prefix}block{g}_")   # shares the children
            names, _, aux_names, _ = block_state(block)
            net = _graph(block, static=False, num_inputs=group[0].num_inputs if isinstance(group[0], Cuttable) else 1)
            segments.append(Segment(net, first, first + len(names), aux_first, aux_first + len(aux_names),
                                    label=f"block {g}", block=block))
            first, aux_first = first + len(names), aux_first + len(aux_names)
        all_names, _, all_aux, _ = block_state(initial)
        # a graph's inputs, in its order (a block without one, in lockstep, reads its arrays by name)
        held = [(s.net.names, s.net.aux_names) if s.net is not None else block_state(s.block)[::2] for s in segments]
        if [n for names, _ in held for n in names] != all_names or [n for _, aux in held for n in aux] != all_aux:
            raise ValueError("the block's arrays are not in the order of its children; recomputation cuts it "
                             "into its children in order")
        return segments

    def export(self, prefix, params, aux=(), initial=None):
        # into the initial block (unused since make_strategy copied it), then gluon's export
        return export_gluon(initial, prefix, params, aux)

    def shard_specs(self, initial):
        """``parallel.models.layers.shard_specs(initial)``: ``{param.name: spec}``, the specs its parallel layers
        declare, ``Replicated()`` for every other array (all of ResNet-18's)."""
        return shard_specs(initial)

    def plan(self, initial):
        """The parallelize plan of the model ``initial`` is (``parallel.models.plan.plan_of``): where sequence
        parallelism's region lies among its children; ``Plan()`` for a block of no model of ``PLANS``."""
        return plan_of(initial)


class BuiltGluonModel(GluonModel):
    """A gluon model of ``MODELS``: a block of one architecture (``build``) initialized from a seed
    (``initialize``), for 1x28x28 images and 10 classes, whose checkpoint holds its trainable arrays and its
    others (BatchNorm's running statistics) under structural names. A model is a subclass naming its two
    functions."""

    #: The images it takes (one example) and the classes it tells apart: what ``fit`` trains.
    input_shape = (1, 1, 28, 28)
    num_classes = 10

    def __init__(self, title):
        super().__init__(title)
        self._layout = None

    def build(self):
        """The model's block, uninitialized."""
        raise NotImplementedError

    def initialize(self, seed):
        """The model's block initialized from ``seed`` on the CPU, its shapes known."""
        raise NotImplementedError

    def init(self, seed=0, params=None, aux=None):
        block = self.initialize(seed)
        if params is None:
            return block
        names, arrays, aux_names, aux_arrays = block_state(block)
        aux = [] if aux is None else list(aux)
        for what, values, targets, target_names in (("trainable", list(params), arrays, names),
                                                    ("non-trained", aux, aux_arrays, aux_names)):
            if len(values) != len(targets):
                raise ValueError(f"{self.title} has {len(targets)} {what} arrays, got {len(values)}")
            for name, value, target in zip(target_names, values, targets):
                if value.shape != target.shape:
                    raise ValueError(f"{name} has shape {target.shape} in {self.title}, got {value.shape}")
                target[:] = value.as_in_context(target.context)
        return block

    def layout(self):
        """Shapes inferred from the graph on ``input_shape`` images, without allocating the arrays (once)."""
        if self._layout is None:
            block = self.build()
            symbol = block(mx.sym.var("data"))
            arg_shapes, _, aux_shapes = symbol.infer_shape(data=self.input_shape)
            shapes = dict(zip(symbol.list_arguments(), arg_shapes))
            shapes.update(zip(symbol.list_auxiliary_states(), aux_shapes))
            by_structure = {name: shapes[param.name] for name, param in structural_params(block).items()}
            names, aux_names = block_names(block)
            self._layout = Layout(tuple(names), tuple(by_structure[n] for n in names), tuple(aux_names),
                                  tuple(by_structure[n] for n in aux_names))
        return self._layout

    def thunks(self, params, aux=()):
        layout = self.layout()
        thunks = dict(zip(layout.names, array_thunks(params, layout.names, layout.shapes, f"{self.title}'s")))
        thunks.update(zip(layout.aux_names, array_thunks(aux, layout.aux_names, layout.aux_shapes,
                                                         f"{self.title}'s running statistics")))
        return thunks


class ResNet18Model(BuiltGluonModel):
    """The textbook's ResNet-18 for 1x28x28 images and 10 classes (``init_resnet18``): a gluon block whose
    checkpoint holds its trainable arrays and its BatchNorm running statistics, under structural names."""

    def build(self):
        return resnet18(num_classes=self.num_classes)

    def initialize(self, seed):
        return init_resnet18(seed, num_classes=self.num_classes, input_shape=self.input_shape)


class ExpertsVariants(BuiltGluonModel):
    """A model of ``MODELS`` whose variants (``parallel.models.model_spec``) may have a mixture of ``experts``
    experts in every other block (``top_k``, ``capacity_factor``, ``aux_weight``, ``z_weight``,
    ``gate_scale``: ``Experts``'s);
    ``options`` the variant's."""

    #: The options that are the model's own sizes, not its experts'.
    sizes = ()

    def __init__(self, title, **options):
        super().__init__(title)
        self.options = options

    def experts(self):
        """The variant's ``Experts``, or None: its options but those of the model's own sizes."""
        options = {k: v for k, v in self.options.items() if k not in self.sizes}
        count = options.pop("experts", 0)
        return Experts(count, **options) if count else None

    def layout(self):
        """As ``BuiltGluonModel.layout``; a variant with experts (which cannot run as a symbol: its layers route
        on the host) reads its shapes from an initialized block."""
        if not self.options.get("experts"):
            return super().layout()
        if self._layout is None:
            block = self.initialize(0)
            names, arrays, aux_names, aux = block_state(block)
            by_name = dict(zip(names + aux_names, [a.shape for a in arrays + aux]))
            structural, aux_structural = block_names(block)
            by_structure = {name: by_name[param.name] for name, param in structural_params(block).items()}
            self._layout = Layout(tuple(structural), tuple(by_structure[n] for n in structural),
                                  tuple(aux_structural), tuple(by_structure[n] for n in aux_structural))
        return self._layout


class ViTModel(ExpertsVariants):
    """The small Vision Transformer for 1x28x28 images and 10 classes (``init_vit``: 7x7 patches, 4 pre-norm
    blocks of width 64): a gluon block whose checkpoint holds its trainable arrays, under structural names (it has
    no others: no BatchNorm). Its variants have a mixture of experts in every other block, or another ``patch``."""

    sizes = ("patch",)

    def _sizes(self):
        """``vit``'s arguments of this variant: its patch and its experts."""
        return {"patch": self.options.get("patch", 7), "experts": self.experts()}

    def build(self):
        return vit(num_classes=self.num_classes, image=self.input_shape[-1], **self._sizes())

    def initialize(self, seed):
        return init_vit(seed, num_classes=self.num_classes, input_shape=self.input_shape, **self._sizes())


class TransformerModel(ExpertsVariants):
    """The small row Transformer for 1x28x28 images and 10 classes (``init_transformer``: the 28 rows as tokens, 2
    post-norm blocks of width 32): a gluon block whose checkpoint holds its trainable arrays, under structural
    names (no BatchNorm). Built of the parallel layers, it splits over a tensor-parallel group as the ViT does; its
    variants have a mixture of experts in its second block."""

    def build(self):
        return transformer(num_classes=self.num_classes, rows=self.input_shape[-2], width=self.input_shape[-1],
                           experts=self.experts())

    def initialize(self, seed):
        return init_transformer(seed, num_classes=self.num_classes, input_shape=self.input_shape,
                                experts=self.experts())


#: The behaviour of a gluon block handed to a strategy, whichever it is.
_ANY_BLOCK = GluonModel("the block")


def behaviour_of(initial):
    """The behaviour of an initial model as the strategies take it: a gluon block's (``GluonModel``), else
    LeNet's (whose methods refuse what is not LeNet's list of arrays).

    >>> import mxnet as mx
    >>> behaviour_of([mx.nd.zeros((1,))]), behaviour_of(mx.gluon.nn.HybridSequential())
    (LeNetModel('LeNet'), GluonModel('the block'))
    """
    return _ANY_BLOCK if isinstance(initial, gluon.Block) else MODELS["lenet"].behaviour
