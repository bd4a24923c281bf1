"""Networks, one per file: the from-scratch LeNet (``lenet``), any gluon block as ``net(X, params)``
(``gluon``), the textbook's ResNet-18 (``resnet``).

Each module's public names are re-exported here; ``parallel`` re-exports them in turn.
"""
from .lenet import (LENET_LAYERS, LENET_SHAPES, CachedNet, init_lenet_params, lenet, lenet_cached,  # noqa: F401
                    lenet_layers, softmax_cross_entropy)
from .gluon import GluonNet, as_net, block_state, set_block_params  # noqa: F401
from .resnet import Residual, init_resnet18, resnet18  # noqa: F401

__all__ = ["init_lenet_params", "lenet", "lenet_layers", "lenet_cached", "CachedNet", "softmax_cross_entropy",
           "LENET_SHAPES", "LENET_LAYERS", "GluonNet", "as_net", "block_state", "set_block_params",
           "Residual", "resnet18", "init_resnet18"]
