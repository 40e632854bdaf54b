"""Which modules and functions do what to the labels of a traced tensor (book: chapter "Symmetries of
real architectures"). See :mod:`symlib.symmetry.trace` for the rules themselves.

The tables name PyTorch's modules, functions and tensor methods; a node whose target is in none of them
and whose inputs carry labels is refused by name.
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.nn import functional as F

# Permutation-equivariant and positively homogeneous: both labels pass.
PASS_MODULES = (
    nn.ReLU, nn.LeakyReLU, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.AlphaDropout, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
PASS_FUNCTIONS = {
    F.relu, torch.relu, torch.relu_, F.relu_, F.leaky_relu, F.dropout, F.dropout1d, F.dropout2d,
    F.dropout3d, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
    F.adaptive_max_pool2d, F.adaptive_max_pool3d, operator.neg, torch.neg,
}
PASS_METHODS = {"relu", "relu_", "contiguous", "clone", "detach", "float", "double", "to", "neg", "__neg__",
                "alias", "type_as"}
# Functions that are the identity in eval mode, known by module and name (no import of their package).
EVAL_IDENTITY = {("torchvision.ops.stochastic_depth", "stochastic_depth")}

# Element-wise but not positively homogeneous: the permutation passes, the scale is fixed.
NONHOMOGENEOUS_MODULES = (
    nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.ReLU6, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid,
    nn.Softmax, nn.LogSoftmax,
)
NONHOMOGENEOUS_FUNCTIONS = {
    torch.tanh, F.tanh, torch.sigmoid, F.sigmoid, F.gelu, F.silu, F.elu, F.selu, F.celu, F.softplus,
    F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.relu6, torch.exp, torch.pow, operator.pow,
}
NONHOMOGENEOUS_METHODS = {"tanh", "tanh_", "sigmoid", "sigmoid_", "exp", "pow", "__pow__"}

# Element-wise arithmetic between tensors (with broadcasting) or with numbers.
ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add, operator.sub, operator.isub, torch.sub}
ADD_METHODS = {"add", "add_", "__add__", "__iadd__", "__radd__", "sub", "sub_", "__sub__", "__isub__"}
MUL_FUNCTIONS = {operator.mul, operator.imul, torch.mul}
MUL_METHODS = {"mul", "mul_", "__mul__", "__imul__", "__rmul__"}
DIV_FUNCTIONS = {operator.truediv, operator.itruediv, torch.div}
DIV_METHODS = {"div", "div_", "__truediv__", "__itruediv__"}

# Shapes: reshapes, reductions over positions, axis moves, concatenation.
RESHAPE_FUNCTIONS = {torch.flatten, torch.squeeze, torch.unsqueeze, torch.reshape}
RESHAPE_METHODS = {"flatten", "view", "reshape", "squeeze", "unsqueeze"}
REDUCE_FUNCTIONS = {torch.mean, torch.amax, torch.sum}
REDUCE_METHODS = {"mean", "amax", "sum"}
MOVE_FUNCTIONS = {torch.permute, torch.transpose, torch.t, torch.movedim}
MOVE_METHODS = {"permute", "transpose", "t", "movedim"}
CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}
LAYER_NORM_FUNCTIONS = {F.layer_norm, F.rms_norm}

# Operations whose result is not a tensor but which only read a labelled tensor's shape.
QUERY_METHODS = {"size", "dim", "numel", "ndimension"}
QUERY_FUNCTIONS = {getattr, torch.numel}
QUERY_NAMES = {"_assert_tensor_metadata", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
               "_assert_async", "_assert_scalar"}  # ATen checks and shape queries (torch.export graphs)
SPLIT_NAMES = {"chunk", "split", "tensor_split", "unbind", "split_with_sizes"}


def name_of(target) -> str:
    """A readable name of a node's target (``"linear"`` for ``torch.ops.aten.linear.default``)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


# ATen operators (graphs from torch.export) as the function or method with the same arguments.
ATEN = {
    "add": operator.add, "sub": operator.sub, "rsub": operator.sub, "mul": operator.mul,
    "div": operator.truediv, "neg": operator.neg, "relu": torch.relu, "gelu": F.gelu, "silu": F.silu,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp, "pow": torch.pow,
    "view": torch.reshape, "reshape": torch.reshape, "_unsafe_view": torch.reshape,
    "unsqueeze": torch.unsqueeze, "squeeze": torch.squeeze, "flatten": torch.flatten,
    "permute": torch.permute, "transpose": torch.transpose, "t": torch.t, "mean": torch.mean,
    "sum": torch.sum, "amax": torch.amax, "cat": torch.cat, "layer_norm": F.layer_norm,
    "rms_norm": F.rms_norm, "dropout": F.dropout, "linear": F.linear, "addmm": torch.addmm,
    "matmul": torch.matmul, "bmm": torch.bmm, "mm": torch.mm, "softmax": torch.softmax,
    "_softmax": torch.softmax, "log_softmax": torch.log_softmax,
    "scaled_dot_product_attention": F.scaled_dot_product_attention,
}
ATEN_METHODS = {"clone", "alias", "contiguous", "detach", "lift_fresh_copy", "masked_fill", "expand"}


def normalize(target, is_method: bool):
    """``(target, is_method)`` with an ATen operator replaced by its function or method equivalent."""
    if not isinstance(target, torch._ops.OpOverload):
        return target, is_method
    name = name_of(target)
    if name in ATEN:
        return ATEN[name], False
    if name in ("_to_copy", "to"):
        return "to", True
    if name in ATEN_METHODS:
        return name, True
    return name, False


def is_eval_identity(target) -> bool:
    return (getattr(target, "__module__", None), getattr(target, "__name__", None)) in EVAL_IDENTITY
