"""Which tensors of a model are normalisation, which are the classifier head and which is
a linear model's weight matrix, found from the model's structure, never from parameter
names (STYLE.md, point 6).

Private-layer options (FedBN keeps normalisation private, FedPer the head, ScalableFL both)
and label-split aggregation (HeteroFL's head rows) need the first two sets; FedALRC's
singular-value thresholding needs the third (`linear_weight`); FedFA's scaling of layer
weights only and ZiCo, the weights of convolution and linear layers (`layer_weight_names`).
A normalisation layer is any PyTorch norm module or a module declaring
`hetfl_role = "norm"`; the head is the module a model exposes as `model.head` (every HetFL
model does, as a submodule or a property naming one).

Other roles are declared the same way (`tensor_roles`): a module's `hetfl_role` gives every
tensor under it that role, its `hetfl_tensor_roles` (own tensor name -> role) gives it to
some of them. FLANC's composed layers declare their shared basis `{"basis": "basis"}`,
which its orthogonality penalty looks for.
"""

from __future__ import annotations

from torch import nn

#: PyTorch's normalisation layers (BatchNorm and InstanceNorm share `_NormBase`); the one
#: definition that finding norm tensors and initialising them (`hetfl.core.init`) both use.
NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_LAYERS) or getattr(module, "hetfl_role", None) == "norm"


def norm_tensor_names(model: nn.Module) -> set[str]:
    """State names (parameters and buffers) that belong to normalisation layers."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if _is_norm(module):
            names.update(_own_state_names(prefix, module))
    return names


def head_tensor_names(model: nn.Module) -> set[str]:
    """State names of `model.head`, under the head's own path in the model (a model may
    name its classifier otherwise and expose it as a `head` property: DTFL's `md8`); an
    error when the model does not mark its head."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(model).__name__} does not mark its classifier as `self.head`")
    prefix = next(name for name, module in model.named_modules() if module is head)
    return {f"{prefix}.{k}" for k in head.state_dict()}


def layer_weight_names(model: nn.Module) -> set[str]:
    """State names of the weight of every convolution and linear layer (a layer's
    multiplicative kernel, as opposed to biases and normalisation affines): what FedFA's
    `scale: weights_only` rescales."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.modules.conv._ConvNd):
            names.add(f"{prefix}.weight" if prefix else "weight")
    return names


def linear_weight(model: nn.Module) -> str | None:
    """The weight's name when every parameter of `model` belongs to one `nn.Linear` (a
    linear model, whose weight matrix a method may treat as such), else None."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1:
        return None
    prefix, layer = linears[0]
    dot = f"{prefix}." if prefix else ""
    owned = {dot + n for n, _ in layer.named_parameters()}
    return dot + "weight" if owned == {n for n, _ in model.named_parameters()} else None


def tensor_roles(model: nn.Module) -> dict[str, str]:
    """The role each declared tensor of `model` has, by state name (see the module
    docstring); tensors whose module declares nothing are not listed."""
    roles: dict[str, str] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        role = getattr(module, "hetfl_role", None)
        if role is not None:
            roles.update((name, role) for name in _own_state_names(prefix, module))
        for own, own_role in getattr(module, "hetfl_tensor_roles", {}).items():
            roles[dot + own] = own_role
    return roles


def _own_state_names(prefix: str, module: nn.Module) -> set[str]:
    dot = f"{prefix}." if prefix else ""
    return {f"{dot}{k}" for k in module.state_dict()}
