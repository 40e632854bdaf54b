"""Networks: the paper's architectures, the registry that names them, and the recipe that rebuilds any
network from a manifest (book: chapters "A gentle example", "Min-mass", "Checkpoint zoos").

* :mod:`~symlib.models.nets`: the architectures (:class:`MLP`, :class:`MLPClassifier`, :class:`OptuNet`,
  :class:`ResNet20`, :class:`ResNet18`);
* :mod:`~symlib.models.registry`: name -> network, its keyword arguments from a state dict's shapes, its
  input shape (:func:`register` adds one);
* :mod:`~symlib.models.recipe`: the :class:`Recipe` every manifest records, which rebuilds the network of a
  set of weights (a registered network, your own factory, a Hugging Face or timm model);
* :mod:`~symlib.models.build`: the networks of a stacked set of weights, one ``nn.Module`` each, and the
  ``"model"`` record manifests keep of a registered network.
"""

from symlib.models.nets import (
    MLP,
    BasicBlock,
    MLPClassifier,
    OptuNet,
    ResNet18,
    ResNet20,
    num_parameters,
    randomize_batchnorm,
)
from symlib.models.recipe import BUILDERS, Recipe, from_config, load_factory, parse_shape
from symlib.models.registry import REGISTRY, Network, network, of_factory, register, unregister

__all__ = ["BUILDERS", "MLP", "REGISTRY", "BasicBlock", "MLPClassifier", "Network", "OptuNet", "Recipe",
           "ResNet18", "ResNet20", "from_config", "load_factory", "network", "num_parameters", "of_factory",
           "parse_shape", "randomize_batchnorm", "register", "unregister"]
