"""The parallel layout of a run as one frozen object, checked once: how a model is spread over the contexts.

A ``Layout`` holds every axis the package runs, and how a step is fed:

- **data**: replicas of the model, each taking a slice of the batch (``data``: how many; None: as many as the
  contexts hold once the other axes have theirs), their gradients summed by the Reducer;
- **pipeline**: the model cut into ``stages`` (or at ``boundaries``), each on its own device, fed ``micro_batches``
  in the order of a ``schedule`` (GPipe, 1F1B), with ``virtual`` chunks a device (interleaved 1F1B);
- **tensor**: each layer split over ``tensor`` contexts (Megatron-LM), for models made of parallel layers;
- **ZeRO** (``zero`` 0-3): the optimizer state, the gradients and the parameters sharded over the data replicas;
- **experts** (``expert_parallel``): a mixture-of-experts model's experts spread over groups of that many data
  replicas, tokens sent to their experts by an all-to-all (``parallel.models.moe``);
- **context** (``context``): each example's sequence split over groups of that many contexts, attention by ring
  attention (``parallel.models.ring``);
- **sequence** (``sequence``, with ``tensor``): the regions tensor parallelism leaves whole split along the
  sequence over each tensor group (Korthikanti et al. 2022);
- ``recompute`` (keep each block's input, compute its forward again in backward), ``accumulate`` (micro-batches
  one after another before one update) and ``compression`` (the data-parallel sums sent compressed).

The strategy's name (``strategy``) is a preset of the axes, not a rule of its own: ``data`` is one stage and one
micro-batch (its micro-batches are ``accumulate``), ``model`` one replica of ``stages`` stages and one micro-batch,
``pipeline`` one replica of stages fed micro-batches, ``hybrid`` all three axes. Every axis composes with every
other; what is refused is what the mathematics cannot run, each with its reason (``Layout.check``):

>>> Layout("hybrid", stages=2, tensor=2, zero=3, recompute=True, micro_batches=4, schedule="1f1b").check("vit")
Layout(strategy='hybrid', stages=2, boundaries=None, micro_batches=4, schedule='1f1b', virtual=1, tensor=2, zero=3, recompute=True, accumulate=1, compression='none', data=None, expert_parallel=1, context=1, sequence=False)
>>> Layout(tensor=2).check("lenet")
Traceback (most recent call last):
    ...
parallel.validate.BadValue: tensor=2 splits layers made of parallel layers (attention heads, MLP units); LeNet has none: use model vit or transformer

Nothing here imports MXNet: the CLI checks its flags with it before MXNet starts; ``make_strategy`` lays the axes
out on the contexts as a ``parallel.mesh.Mesh`` (``Layout.place``), the one place ranks are computed.
"""
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from .comm import SHARDED_ALGORITHMS
from .compress import parse_compression
from .mesh import Mesh
from .models import MODELS, model_info
from .optim import ZERO_LEVELS
from .strategies import DEFAULT_MICRO_BATCHES, DEFAULT_STAGES, PIPELINE_SCHEDULES, STRATEGIES
from .validate import BadType, BadValue, check_bool, check_choice, check_int

__all__ = ["Layout", "PRESETS", "preset_micro_batches"]

#: What each strategy's name fixes (a value a user may not change) and its defaults (``None``: no fixed value).
PRESETS = {
    "data": {"fixed": {"stages": 1, "micro_batches": 1}, "defaults": {}},
    "model": {"fixed": {"data": 1, "micro_batches": 1}, "defaults": {"stages": DEFAULT_STAGES}},
    "pipeline": {"fixed": {"data": 1}, "defaults": {"stages": DEFAULT_STAGES, "micro_batches": DEFAULT_MICRO_BATCHES}},
    "hybrid": {"fixed": {}, "defaults": {"stages": DEFAULT_STAGES, "micro_batches": 1}},
}

def preset_micro_batches(strategy):
    """The micro-batches a pipeline of the preset ``strategy`` is fed when none are given: its fixed value, else its
    default, else 1."""
    preset = PRESETS[strategy]
    return preset["fixed"].get("micro_batches", preset["defaults"].get("micro_batches", 1))


#: How each fixed axis reads in a refusal: what the preset is, and what to use instead.
_FIXED = {
    "stages": ("{stages} and {boundaries} cut the model into pipeline stages; the data strategy keeps it whole",
               "drop them, or use the hybrid {strategy} (data x stages)"),
    "micro_batches": ("{micro_batches} feed a pipeline", "use {accumulate} for micro-batches of a whole model, or the "
                                                         "pipeline or hybrid {strategy}"),
    "data": ("{data} replicas are the data and hybrid strategies' axis", "use the hybrid {strategy}"),
}


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout (see the module's docstring). Constructing one checks each field alone (types,
    ranges, the preset's fixed axes); ``check`` checks them together against the model's capabilities.

    Attributes
    ----------
    strategy : str
        The preset (``STRATEGIES``): ``"data"``, ``"model"``, ``"pipeline"`` or ``"hybrid"``.
    stages : int, optional
        Pipeline stages (devices a replica spans); default 1 for ``data``, else ``DEFAULT_STAGES`` unless
        ``boundaries`` are given.
    boundaries : tuple of int, optional
        The layer indices where stages (with ``virtual``, chunks) start, instead of ``stages``.
    micro_batches : int, optional
        Micro-batches a replica's pipeline is fed per batch (default ``DEFAULT_MICRO_BATCHES`` for ``pipeline``,
        1 otherwise); a batch with fewer examples runs one a example.
    schedule : str
        The order a pipeline issues its work in (``PIPELINE_SCHEDULES``).
    virtual : int
        Model chunks a pipeline device holds (more than 1: interleaved 1F1B).
    tensor : int
        Contexts each layer is split over.
    zero : int
        ZeRO's stage, 0 to 3, over the data replicas (and the workers of a job).
    recompute : bool
        Activation recomputation of each block.
    accumulate : int
        Micro-batches of a whole batch run one after another before one update.
    compression : str
        How the data-parallel sums are compressed (``parallel.compress.parse_compression``).
    data : int, optional
        Data-parallel replicas in one process (None: every context left; 1 for ``model`` and ``pipeline``).
    expert_parallel : int
        Data replicas that share a mixture of experts' experts (an expert-parallel group); 1: each holds all.
    context : int
        Contexts that share each example's sequence (a context-parallel group, ring attention); 1: none.
    sequence : bool
        Sequence parallelism (with ``tensor``): the layer norms and the residual stream split along the sequence
        over each tensor group, f and g an all-gather and a reduce-scatter.
    """
    strategy: str = "data"
    stages: Optional[int] = None
    boundaries: Optional[Tuple[int, ...]] = None
    micro_batches: Optional[int] = None
    schedule: str = "gpipe"
    virtual: int = 1
    tensor: int = 1
    zero: int = 0
    recompute: bool = False
    accumulate: int = 1
    compression: str = "none"
    data: Optional[int] = None
    expert_parallel: int = 1
    context: int = 1
    sequence: bool = False

    def __post_init__(self):
        check_choice(self.strategy, "strategy", tuple(STRATEGIES))
        if self.stages is not None:   # how many the model's layers allow: stage_ranges's
            check_int(self.stages, "stages")
        for name in ("micro_batches", "data"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, low=1)
        if self.boundaries is not None:
            if isinstance(self.boundaries, (str, bytes)) or not hasattr(self.boundaries, "__iter__"):
                raise BadType("boundaries", f"{{boundaries}} must be a sequence of layer indices, got "
                                            f"{self.boundaries!r}")
            object.__setattr__(self, "boundaries", tuple(self.boundaries))
            for i, b in enumerate(self.boundaries):
                check_int(b, f"boundaries[{i}]")
        if self.stages is not None and self.boundaries is not None:
            raise BadValue("stages", "{stages} and {boundaries} both say where to cut; give one of them")
        check_choice(self.schedule, "schedule", tuple(PIPELINE_SCHEDULES))
        check_int(self.virtual, "virtual_stages", low=1)
        check_int(self.tensor, "tensor", low=1)
        if isinstance(self.zero, bool) or not isinstance(self.zero, int):
            raise BadType("zero", f"{{zero}} must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.zero not in ZERO_LEVELS:
            raise BadValue("zero", f"{{zero}} must be 0, 1, 2 or 3, got {self.zero!r}")
        check_bool(self.recompute, "recompute")
        check_int(self.accumulate, "accumulate", low=1)
        parse_compression(self.compression)
        check_int(self.expert_parallel, "expert_parallel", low=1)
        check_int(self.context, "context", low=1)
        check_bool(self.sequence, "sequence")
        self._check_preset()

    def _check_preset(self):
        """The axes the strategy's name fixes may not be given another value."""
        fixed = PRESETS[self.strategy]["fixed"]
        given = {"stages": self.stages if self.boundaries is None else len(self.boundaries) + 1,
                 "micro_batches": self.micro_batches, "data": self.data}
        for axis, value in fixed.items():
            if given[axis] is not None and given[axis] != value:
                what, instead = _FIXED[axis]
                argument = "boundaries" if axis == "stages" and self.boundaries is not None else axis
                raise BadValue(argument, f"{what}, not the {self.strategy} {{strategy}}'s ({axis} = {value}); {instead}")
        if self.stages_given == 1 and (self.schedule != "gpipe" or self.virtual > 1):
            raise BadValue("schedule", "{schedule} and {virtual_stages} order a pipeline's micro-batches over its "
                                       f"stages; the {self.strategy} {{strategy}} has one stage: give {{stages}} or "
                                       "use the pipeline or hybrid {strategy}")

    # ---- the resolved axes --------------------------------------------------------------------------------------

    @property
    def stages_given(self):
        """Pipeline devices as given or fixed (``len(boundaries) + 1`` chunks dealt ``virtual`` a device), or the
        preset's default."""
        if self.boundaries is not None:
            return (len(self.boundaries) + 1) // self.virtual or 1
        if self.stages is not None:
            return self.stages
        return PRESETS[self.strategy]["fixed"].get("stages", PRESETS[self.strategy]["defaults"].get("stages", 1))

    @property
    def chunks(self):
        """The model chunks the pipeline cuts: ``stages x virtual``, or ``len(boundaries) + 1``."""
        return len(self.boundaries) + 1 if self.boundaries is not None else self.stages_given * self.virtual

    @property
    def micro(self):
        """Micro-batches a replica's pipeline is fed per batch (the preset's when not given)."""
        return self.micro_batches if self.micro_batches is not None else preset_micro_batches(self.strategy)

    @property
    def pipelined(self):
        """Whether a replica is cut into more than one chunk, or fed more than one micro-batch."""
        return self.chunks > 1 or self.micro > 1

    def replace(self, **changes):
        """A copy with ``changes`` (checked as a new layout)."""
        return replace(self, **changes)

    # ---- checks against the model and the reduction -------------------------------------------------------------

    def check(self, model=None, batch_size=None, algorithm=None):
        """Check the axes together, against the model ``model`` (a name of ``MODELS``: the layers it splits), the
        global ``batch_size`` and the allreduce ``algorithm`` when given; returns the layout. Raises ``BadValue``
        with the reason for what the mathematics cannot run."""
        if self.virtual > 1:
            self._check_interleaving()
        if batch_size is not None:
            n = check_int(batch_size, "batch_size", low=1)
            if self.micro > n:
                raise BadValue("micro_batches", f"{{micro_batches={self.micro}}} cannot split batches of {n} "
                                                f"examples; use at most {n} micro-batches or a larger {{batch_size}}")
            check_int(self.accumulate, "accumulate", low=1, high=n)
        if self.zero >= 2 and algorithm is not None and algorithm not in SHARDED_ALGORITHMS:
            raise BadValue("zero", f"{{zero={self.zero}}} reduce-scatters the gradients, and the {algorithm} allreduce "
                                   f"has no reduce-scatter half; use {{algorithm}} {' or '.join(SHARDED_ALGORITHMS)}")
        if self.zero == 3 and parse_compression(self.compression)[0] != "none":
            raise BadValue("compression", "{compression}'s error feedback keeps a residual of the whole gradient on "
                                          "every context, the memory {zero=3} shards away; use {zero} 0, 1 or 2 "
                                          "with compression")
        if self.sequence:
            self._check_sequence()
        if model is not None:
            self._check_model(model)
        return self

    def _check_sequence(self):
        if self.tensor == 1:
            raise BadValue("sequence", "{sequence} splits along the sequence what tensor parallelism leaves whole on "
                                       "every rank of a group (layer norms, the residual stream); give {tensor} 2 or "
                                       "more")


    def _check_interleaving(self):
        v = self.virtual
        if self.schedule != "1f1b":
            raise BadValue("virtual_stages", f"{{virtual_stages={v}}} interleaves 1F1B; use {{schedule}} 1f1b")
        if self.boundaries is not None and (len(self.boundaries) + 1) % v:
            raise BadValue("boundaries", f"{{boundaries}} cut {len(self.boundaries) + 1} chunks, which cannot be "
                                         f"dealt {v} a device ({{virtual_stages={v}}}); give a multiple of {v} chunks")
        devices = self.stages_given
        if self.micro % devices:
            raise BadValue("micro_batches", f"interleaving takes the micro-batches {devices} at a time, one a "
                                            f"stage: {{micro_batches={self.micro}}} must be a multiple of {devices}")

    def _check_model(self, model):
        info = model_info(model)
        if (self.context > 1 or self.sequence) and not info.sequences:
            runs = [name for name, entry in MODELS.items() if entry.sequences]
            if self.sequence:
                raise BadValue("sequence", f"{{sequence}} splits the tokens of a model whose embedding and head know "
                                           f"it; {info.title}'s do not: use {{model}} {' or '.join(runs)}")
            raise BadValue("context", f"{{context={self.context}}} splits the sequence of a model whose attention "
                                      f"runs round a ring; {info.title} has none: use {{model}} {' or '.join(runs)}")
        if self.tensor > 1:
            splits = [name for name, entry in MODELS.items() if entry.tensor]
            if not info.tensor:
                raise BadValue("tensor", f"{{tensor={self.tensor}}} splits layers made of parallel layers (attention "
                                         f"heads, MLP units); {info.title} has none: use {{model}} "
                                         f"{' or '.join(splits)}")
            if self.tensor > info.tensor:
                raise BadValue("tensor", f"{{tensor={self.tensor}}} ranks cannot split {info.title}'s {info.tensor} "
                                         f"attention heads; use at most {info.tensor}")

    def place(self, contexts, workers=1, worker=0):
        """Where the layout puts the model: a ``parallel.mesh.Mesh`` of the contexts it uses. ``contexts``: a list
        of contexts (the mesh holds the ones it uses, in rank order) or their number (a mesh of ranks alone);
        ``workers``, ``worker``: the job's (the data axis goes on over them). The data and hybrid strategies use
        every context (a multiple of ``stages x tensor x context``); model and pipeline one replica of ``stages x
        tensor`` contexts, the rest idle."""
        given = None if isinstance(contexts, int) and not isinstance(contexts, bool) else list(contexts)
        k = check_int(contexts if given is None else len(given), "ctx_list", low=1)
        if self.context > 1 and k % self.context:   # groups of contexts that share each example's sequence
            raise BadValue("context", f"{{context={self.context}}} cannot group {k} contexts of {{ctx_list}}; use a "
                                      f"multiple of {self.context} contexts")
        s, t = self.stages_given, self.tensor
        width = s * t * self.context
        if k < width:
            what = f"{s} stages" if t == 1 else f"{s} stage(s) of {{tensor={t}}}"
            raise BadValue("ctx_list", f"{what} need {width} contexts, got {k} in {{ctx_list}}; use fewer {{stages}} "
                                       "or more contexts")
        data = self.data if self.data is not None else PRESETS[self.strategy]["fixed"].get("data")
        if data is None and k % width:
            lower = k // width * width
            what = (f"{{tensor={t}}}" if s == 1 else f"{s} {{stages}}" if t == 1 else f"{s} {{stages}} of "
                    f"{{tensor={t}}}")
            raise BadValue("ctx_list", f"{k} contexts in {{ctx_list}} cannot form equal groups of {what}; use a "
                                       f"multiple of {width} contexts (e.g. {lower or width} or {lower + width})")
        data = k // width if data is None else data
        if data * width > k:
            raise BadValue("data", f"{{data={data}}} replicas of {width} contexts need {data * width} contexts, got {k}")
        if data % self.expert_parallel:
            raise BadValue("expert_parallel", f"{{expert_parallel={self.expert_parallel}}} cannot group {data} "
                                              "replicas; use a divisor of the replicas")
        used = None if given is None else given[:data * width]
        return Mesh(data // self.expert_parallel, self.expert_parallel, self.context, s, t, used, workers, worker)

    @staticmethod
    def describe_axes(mesh):
        """A mesh's axes in words: ``"2 replicas x 2 stages x 2 tensor ranks"`` (an axis of one left out)."""
        parts = [(mesh.replicas, "replica"), (mesh.shape.stage, "stage"), (mesh.shape.tensor, "tensor rank")]
        words = [f"{n} {what}{'s' if n > 1 else ''}" for n, what in parts if n > 1]
        return " x ".join(words) or "one context"
