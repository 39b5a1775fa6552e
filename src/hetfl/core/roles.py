"""Which tensors of a model are normalisation and which are the classifier head, found from
the model's structure, never from parameter names (STYLE.md, point 6).

Private-layer options (FedBN keeps normalisation private, FedPer the head, ScalableFL both)
and label-split aggregation (HeteroFL's head rows) need these sets. A normalisation layer
is any PyTorch norm module or a module declaring `hetfl_role = "norm"`; the head is the
module a model exposes as `model.head` (every HetFL model does).
"""

from __future__ import annotations

from torch import nn

_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORMS) or getattr(module, "hetfl_role", None) == "norm"


def norm_tensor_names(model: nn.Module) -> set[str]:
    """State names (parameters and buffers) that belong to normalisation layers."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if _is_norm(module):
            names.update(_own_state_names(prefix, module))
    return names


def head_tensor_names(model: nn.Module) -> set[str]:
    """State names of `model.head`; an error when the model does not mark its head."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(model).__name__} does not mark its classifier as `self.head`")
    return {f"head.{k}" for k in head.state_dict()}


def _own_state_names(prefix: str, module: nn.Module) -> set[str]:
    dot = f"{prefix}." if prefix else ""
    return {f"{dot}{k}" for k in module.state_dict()}
