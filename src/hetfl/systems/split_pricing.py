"""A split model's cuts priced by the cost model that charges the clients, for methods that
plan from them (DTFL's tier profiling; `hetfl.core.pricing`).

For a cut given as the specs of its two sides, on a batch of B samples:

- client MACs: one training pass of the client spec over the run's inputs, as a client's
  default pass is priced;
- server MACs: one training pass of the server spec over the activation, its input needing
  no gradient (a server that answers with the activation's gradient records
  "train+input" passes, which are not what is priced here);
- batch bytes: the activation of B samples plus B int64 labels (HetFL's labels), as the
  channel counts them;
- model bytes: the client spec's tensors its index map sends, as the payload is counted.

MACs are counted as `hetfl.systems.costs.MacCounter` counts them (`hetfl.systems.products.
MacTally`: torch's FLOP formulas for matrix products and convolutions, halved), module by
module of the pipeline (`ModelFamily.modules`): a side's training pass is the sum of its
modules' passes, the first without its input's gradient and every later one with it, so
the seven cuts of a model cost about two forward passes of the whole model to price.
Modules of the whole model (`family.global_spec`) are taken from it; a client's own extra
modules (DTFL's heads) from the client model, reading the activation at the cut.
Under the simulated clock a profile is then exact: a client's costs in a round are its
batches times these (MACs and bytes grow linearly with the batch) plus the model's transfer.
"""

from __future__ import annotations

from typing import Any

import torch

from hetfl.core.init import build_model
from hetfl.core.pricing import CutCost, check_rate
from hetfl.core.spec import Spec, local_names
from hetfl.core.types import ModelFamily
from hetfl.systems.products import MacTally

#: Bytes of one label as the channel sends it (class indices are int64 in HetFL's data).
LABEL_BYTES = torch.empty((), dtype=torch.int64).element_size()


class SplitPricer:
    """`SplitPricing` over a family, the clients' input shape (C, H, W) and the server's
    compute rate (MAC/s). Each module's pass is priced once."""

    def __init__(
        self, family: ModelFamily, input_shape: tuple[int, ...], server_rate: float
    ) -> None:
        self.family, self.input_shape = family, tuple(input_shape)
        self._server_rate = check_rate(server_rate)
        self._whole: dict[Spec, tuple[torch.nn.Module, dict[str, tuple[int, ...]], int]] = {}
        self._macs: dict[tuple[Spec, str, bool, int], int] = {}
        self._modules: dict[Spec, list[str]] = {}

    @property
    def server_rate(self) -> float:
        return self._server_rate

    def cut_cost(self, client: Spec, server: Spec, batch: int) -> CutCost:
        whole = self.family.global_spec([client])
        _, shapes, element = self._pipeline(whole)
        cut = shapes[self._names(server)[0]]  # one sample's activation at the cut
        client_macs = self._side_macs(client, whole, cut, batch)
        server_macs = self._side_macs(server, whole, cut, batch)
        activation = batch * int(torch.Size(cut).numel()) * element
        sent = set(local_names(self.family.index_map(client)))
        tensors = build_model(self.family, client).state_dict()
        model = sum(t.numel() * t.element_size() for k, t in tensors.items() if k in sent)
        return CutCost(batch, client_macs, server_macs, activation + batch * LABEL_BYTES, model)

    def _side_macs(self, side: Spec, whole: Spec, cut: tuple[int, ...], batch: int) -> int:
        """One training pass of `side`: its modules' passes, the first without an input
        gradient. A module of the whole model is priced there; another (a head) in the
        side's own model, over the activation at the cut."""
        own: torch.nn.Module | None = None
        total = 0
        whole_model, shapes, _ = self._pipeline(whole)
        for i, name in enumerate(self._names(side)):
            if name in shapes:
                owner, module, shape = whole, dict(whole_model.named_modules())[name], shapes[name]
            else:
                if own is None:
                    own = build_model(self.family, side)
                owner, module, shape = side, dict(own.named_modules())[name], cut
            total += self._module_macs(owner, name, module, shape, i > 0, batch)
        return total

    def _module_macs(
        self,
        owner: Spec,
        name: str,
        module: torch.nn.Module,
        shape: tuple[int, ...],
        input_grad: bool,
        batch: int,
    ) -> int:
        key = (owner, name, input_grad, batch)
        if key not in self._macs:
            x = torch.zeros((batch, *shape), requires_grad=input_grad)
            module.eval()  # normalisation is not counted; eval mode spares its statistics
            with MacTally(backward=True) as tally:
                module(x)
            self._macs[key] = tally.total
        return self._macs[key]

    def _names(self, spec: Spec) -> list[str]:
        if spec not in self._modules:
            self._modules[spec] = list(self.family.modules(spec))
        return self._modules[spec]

    def _pipeline(self, whole: Spec) -> tuple[torch.nn.Module, dict[str, tuple[int, ...]], int]:
        """The whole model, the shape of one sample's input to each of its pipeline modules,
        and the element size of what flows between them."""
        if whole not in self._whole:
            model = build_model(self.family, whole)
            shapes: dict[str, tuple[int, ...]] = {}
            sizes: list[int] = []
            named = dict(model.named_modules())
            handles = []
            for name in self._names(whole):

                def hook(module: torch.nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                    shapes[name] = tuple(args[0].shape[1:])
                    sizes.append(args[0].element_size())

                handles.append(named[name].register_forward_pre_hook(hook))
            try:
                with torch.no_grad():
                    model.eval()(torch.zeros((1, *self.input_shape)))
            finally:
                for h in handles:
                    h.remove()
            self._whole[whole] = (model, shapes, max(sizes))
        return self._whole[whole]
