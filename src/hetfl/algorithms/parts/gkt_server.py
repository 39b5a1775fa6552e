"""FedGKT's server phase: the server model trained on every client's uploaded features.

He, Annavaram and Avestimehr, "Group Knowledge Transfer: Federated Learning of Large CNNs
at the Edge" (NeurIPS 2020, §3, Algorithm 1, server part; FedML-AI/FedML
`simulation/mpi/fedgkt/GKTServerTrainer.py`, `train_large_model_on_the_server`). Once the
round's clients have uploaded (`hetfl.core.server.phase`), for each of `epochs` epochs the
server runs through the clients in id order and each client's samples batch by batch:
forward the feature maps through the server model (md2..md8), the loss (cross-entropy,
plus alpha · KD(server ‖ client logits) with distillation on the server), zero the
gradients, backward, step. The logits of the last epoch, computed before each batch's step
in train mode as FedML records them, are each client's download, rows by sample index.

Where HetFL decides: FedML's server visits a client's batches in the order the client
extracted them (one pass of its shuffled loader, the same for every server epoch); here
that order is one permutation per client and round drawn from the phase's generator
(seed, round, SERVER, "server-phase"), kept for every epoch. The optimiser is one for the
whole run, as FedML's (`Adam(amsgrad=True)`, lr 1e-3, weight decay 1e-4 by default): its
state is the phase's extra state (`"server_phase"`), checkpointed. FedML's
`ReduceLROnPlateau` on the server's test accuracy is not reproduced (HetFL's server has no
test set of its own; `train.lr_plateau` is the run-wide rule). With distillation on the
server FedML weights the other way round (KD + alpha·CE); both agree at alpha = 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hetfl.algorithms.parts.gkt_distill import kd_loss
from hetfl.core.client.trainable import Trainable
from hetfl.core.server.phase import PhaseResult, Upload
from hetfl.core.spec import Spec
from hetfl.core.state import State, extract
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ModelFamily, PassRecord

#: The key of the server optimiser's state in the strategy's extra state.
EXTRA = "server_phase"


@dataclass
class GKTServer:
    """The phase (`hetfl.core.server.phase.ServerPhase`) for the server model `spec` of
    `family`, trained with `settings` (its optimiser, lr, weight decay, batch size) for
    `epochs`; `feature_channels` is the channel count of an uploaded feature map."""

    family: ModelFamily
    spec: Spec
    settings: LocalTraining
    epochs: int
    temperature: float
    alpha: float
    distill: bool
    feature_channels: int
    optimiser_state: dict[str, torch.Tensor] = field(default_factory=dict)

    def uploads(self, info: ClientInfo, spec: Spec) -> dict[str, tuple[int, ...]]:
        n, (_, h, w) = info.n_train, info.input_shape
        return {
            "features": (n, self.feature_channels, h, w),
            "logits": (n, int(spec["num_classes"])),
            "labels": (n,),
            "indices": (n,),
        }

    def run(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        uploads: Sequence[Upload],
        generator: torch.Generator,
    ) -> PhaseResult:
        if not uploads:
            return PhaseResult(dict(state))
        imap = self.family.index_map(self.spec)
        server = Trainable.of(
            self.family, self.spec, extract(state, imap), self.settings, self.optimiser_state
        )
        orders = [torch.randperm(u.num_examples, generator=generator) for u in uploads]
        answers = {u.cid: torch.zeros_like(u.tensors["logits"]) for u in uploads}
        batches: dict[int, int] = {}
        size = self.settings.batch_size
        for epoch in range(self.epochs):
            for upload, order in zip(uploads, orders, strict=True):
                for start in range(0, upload.num_examples, size):
                    rows = order[start : start + size]
                    out = self._step(server, upload.tensors, rows)
                    if epoch == self.epochs - 1:
                        answers[upload.cid][upload.tensors["indices"][rows]] = out
                    batches[int(rows.shape[0])] = batches.get(int(rows.shape[0]), 0) + 1
        self.optimiser_state = server.kept()
        trained = server.tensors()
        new_state = dict(state)
        new_state.update({e.global_name: trained[e.local] for e in imap})
        passes = [PassRecord(self.spec, "train", b, n) for b, n in sorted(batches.items())]
        shape = tuple(uploads[0].tensors["features"].shape[1:])
        downloads = {cid: {"logits": logits} for cid, logits in answers.items()}
        return PhaseResult(new_state, downloads, passes, shape)

    def _step(self, server: Trainable, upload: State, rows: torch.Tensor) -> torch.Tensor:
        """One server step on `rows` of a client's upload; the logits before the step."""
        out = server.model(upload["features"][rows])  # (B, classes)
        loss = F.cross_entropy(out, upload["labels"][rows])
        if self.distill:
            loss = loss + self.alpha * kd_loss(out, upload["logits"][rows], self.temperature)
        server.train(loss)
        return out.detach()

    def extra_state(self) -> dict[str, Any]:
        return {EXTRA: dict(self.optimiser_state)}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.optimiser_state = dict(state.get(EXTRA, {}))
