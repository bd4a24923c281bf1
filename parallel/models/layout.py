"""What each model of ``MODELS`` is made of: its initial arrays, and the names and shapes a checkpoint stores.

``init_model(name, seed)`` gives a run's initial model: LeNet's eight arrays, or the other models' (ResNet-18,
the ViT, the Transformer) initialized gluon block; ``model_layout(name)`` the ``Layout`` of its arrays, by name,
independent of how a strategy lays them out on contexts. Both check the name and ask the model's entry
(``MODELS[name].behaviour``, a class of ``parallel.models.registry``):

>>> layout = model_layout("lenet")
>>> layout.names[:2], layout.shapes[0], layout.aux_names
(('conv1_weight', 'conv1_bias'), (20, 1, 3, 3), ())
"""
from typing import NamedTuple

from ..mxnet_compat import structural_params
from . import MODELS, model_info

__all__ = ["Layout", "model_layout", "block_names", "init_model"]


class Layout(NamedTuple):
    """How a checkpoint stores a model: the names and shapes of its trainable arrays, then of the others."""
    names: tuple
    shapes: tuple
    aux_names: tuple
    aux_shapes: tuple


def block_names(block):
    """The names of a gluon block's arrays that are the same for every instance of the network.

    gluon's ``Parameter.name`` counts the instances made so far (``hybridsequential3_conv0_weight``) unless a
    block is given its prefix (the package's models are: ``resnet18_``, ``vit_``, ``transformer_``), so a
    user's block names its arrays differently in each instance. The structural names (``"0.0.weight"``: child 0,
    its child 0, ``weight``), which ``save_parameters`` writes, do not change.

    Returns
    -------
    (list of str, list of str)
        The trainable arrays' names and the others', in ``parallel.models.block_state`` order (which is what
        ``get_params(block, ctx)`` replicas and the strategies' ``params()`` and ``aux()`` follow). The block
        need not be initialized.
    """
    structural = {id(param): name for name, param in structural_params(block).items()}
    names, aux_names = [], []
    for param in block.collect_params().values():
        (aux_names if param.grad_req == "null" else names).append(structural[id(param)])
    return names, aux_names


def model_layout(model):
    """The ``Layout`` of a model of ``MODELS``: what its checkpoint holds (``MODELS[model].behaviour.layout()``).

    A gluon model's shapes are inferred from its graph on 1x28x28 images with 10 classes (what ``fit`` trains),
    without allocating its arrays.

    >>> layout = model_layout("resnet18")
    >>> len(layout.names), len(layout.aux_names), layout.names[0], layout.shapes[0], layout.aux_names[0]
    (76, 34, '0.0.weight', (64, 1, 3, 3), '0.1.running_mean')
    """
    return model_info(model).behaviour.layout()


def init_model(model="lenet", seed=0, params=None, aux=None):
    """The initial model of a run, as ``make_strategy`` takes it (``MODELS[model].behaviour.init``).

    Parameters
    ----------
    model : str
        ``"lenet"`` (the from-scratch LeNet), ``"resnet18"`` (the textbook's ResNet-18 for 1x28x28 images and
        10 classes, ``init_resnet18``) or ``"vit"`` (the small Vision Transformer, ``init_vit``): one of ``MODELS``.
    seed : int
        Seeds the initial values when ``params`` is not given.
    params, aux : list of NDArray, optional
        Values to start from (a checkpoint's): the trainable arrays and the others (BatchNorm's running
        statistics), in ``block_state`` order for a gluon model (``aux`` is required with ResNet-18; the ViT has
        none); LeNet's eight, and no ``aux``, for LeNet. Copied, not modified.

    Returns
    -------
    list of NDArray or mxnet.gluon.nn.HybridSequential
        LeNet's eight arrays (on the CPU), or the other models' (ResNet-18, the ViT, the Transformer) initialized
        gluon block on the CPU.

    Raises
    ------
    ValueError
        For an unknown model, or arrays that do not fit it (count, shape).
    """
    return model_info(model).behaviour.init(seed, params, aux)
