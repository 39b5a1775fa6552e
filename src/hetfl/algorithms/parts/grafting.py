"""Layer grafting (Park and Joe-Wong, "Federated Learning with Flexible Architectures",
ECML-PKDD 2024, §4.2, Algorithm 2): a client's model is brought to the global depth before
aggregation by grafting the last residual block of each of its sections into the deeper
blocks of that section it lacks, so every client contributes to every block.

HetFL grafts through the index map, with no copy: the client's last block of a section gets
one more entry per missing block, its tensors placed into that block's global tensors at its
own width (the repeats of `hetfl.core.spec`). Extraction reads a local tensor from its first
entry, so the client downloads its own blocks only (Algorithm 3: the first d blocks of each
section) and uploads each tensor once; aggregation writes it into every block it stands in
for. Only identity blocks are grafted (no stride, no projection shortcut: the one shape a
section's later blocks share); a section's last block is one wherever the client's depth
there is at least 2, and anything else is refused. The family says which blocks are
identity blocks (`SectionBlock.identity`): a ResNet's blocks without a shortcut
convolution, MobileNetV2's inverted residuals after a stage's first (stride 1, equal
widths, the input added), so a stage's first block, which strides or changes channels, is
never a graft target, and MobileNetV2's one-block stages are never grafted (every client
has their one block).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch

from hetfl.core.spec import IndexMap, MapEntry, SectionBlock, Spec
from hetfl.core.types import ClientInfo, ModelFamily


@runtime_checkable
class Sectioned(Protocol):
    """A family whose models are built in sections of residual blocks (the ResNets and
    MobileNetV2 of `hetfl.models.scalable`)."""

    def sections(self, spec: Spec) -> list[list[SectionBlock]]: ...


def sectioned(family: ModelFamily, method: str) -> Sectioned:
    """`family` as a `Sectioned` one whose base model has sections of blocks, or an error
    naming the models that do."""
    if isinstance(family, Sectioned):
        try:
            family.sections(family.global_spec([]))
            return family
        except ValueError:
            pass
    raise ValueError(
        f"{method} grafts residual blocks: it needs a model built in sections of blocks "
        "(model.name preresnet, resnet18, mobilenetv2, efficientnetv2-s or efficientnetv2-tiny)"
    )


def graft(family: Sectioned, imap: IndexMap, spec: Spec, global_spec: Spec) -> IndexMap:
    """`imap` with, for each section shallower than the global model's, the entries of its
    last block repeated into each deeper global block of the section (same index: identity
    blocks of a section have one shape). Entries the map lacks (private layers) stay out."""
    first = {e.local: e for e in reversed(imap)}
    out = list(imap)
    for s, (own, full) in enumerate(
        zip(family.sections(spec), family.sections(global_spec), strict=False)
    ):
        if not own or len(own) >= len(full):
            continue
        source = own[-1]
        for target in full[len(own) :]:
            if not (source.identity and target.identity):
                raise ValueError(
                    f"section {s + 1}: grafting {source.path} into {target.path} needs two "
                    f"identity blocks (no stride, no projection); a client of depth "
                    f"{len(own)} there has none to graft: use depths >= 2"
                )
            for name in source.tensors:
                entry = first.get(name)
                if entry is None:
                    continue
                if not entry.global_name.endswith(name):
                    raise ValueError(
                        f"grafting needs {name!r} placed in a global tensor of its own name "
                        f"(or a group's copy of it), got {entry.global_name!r}"
                    )
                suffix = name[len(source.path) :]
                group = entry.global_name[: len(entry.global_name) - len(name)]
                out.append(MapEntry(name, f"{group}{target.path}{suffix}", entry.index, entry.mask))
    return out


class Grafting:
    """The map transform of grafting (`graft`), with and without a client, into the global
    spec that `global_spec()` gives once set-up has assigned every client."""

    def __init__(self, family: Sectioned, global_spec: Callable[[], Spec]) -> None:
        self.family, self.global_spec = family, global_spec

    def shared(self, imap: IndexMap, spec: Spec) -> IndexMap:
        return graft(self.family, imap, spec, self.global_spec())

    def for_client(
        self, imap: IndexMap, spec: Spec, client: ClientInfo, state: Mapping[str, torch.Tensor]
    ) -> IndexMap:
        return self.shared(imap, spec)
