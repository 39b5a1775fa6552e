"""Knowledge distillation between a client and a server model, aligned by sample index.

FedGKT (He, Annavaram and Avestimehr, "Group Knowledge Transfer: Federated Learning of
Large CNNs at the Edge", NeurIPS 2020, §3, Eq. (4)-(7)) distils in both directions: a
client learns from the logits the server computed for its samples, and the server (with
distillation on the server) from the client's. The loss is FedML's `KL_Loss`
(FedML-AI/FedML, `simulation/mpi/fedgkt/utils.py`):

    KD(student ‖ teacher) = T² · KL(softmax(teacher / T) + 1e-7 ‖ softmax(student / T))

averaged over the batch (`batchmean`), the 1e-7 added to the teacher's probabilities as
FedML adds it. This module holds that loss, the client's loss term that reads the server's
logits delivered with its task (`ClientTask.download`, rows by sample index, looked up
through `TrainContext.indices`, so a client keeps its own seeded batch order: FedML looks
them up by batch position, which a shuffled loader misaligns), and the client's upload of
its whole training set's feature maps, logits, labels and indices
(`hetfl.core.server.phase`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetfl.core.client.recipe import ModelCall, TrainContext
from hetfl.core.pixels import model_inputs
from hetfl.core.types import ClientData, PassRecord, State

#: FedML's floor on the teacher's probabilities (`KL_Loss`).
TEACHER_FLOOR = 1e-7

#: The names of a client's upload: feature maps (n, C, H, W), its logits (n, classes), its
#: labels (n,) and the samples' indices in its training set (n,), rows in the same order.
UPLOAD_NAMES = ("features", "logits", "labels", "indices")


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² KL(softmax(teacher/T) + 1e-7 ‖ softmax(student/T)), batch mean; both (B, C)."""
    log_student = F.log_softmax(student / temperature, dim=1)
    target = F.softmax(teacher / temperature, dim=1) + TEACHER_FLOOR
    kl = F.kl_div(log_student, target, reduction="batchmean")
    return temperature * temperature * kl


@dataclass(frozen=True)
class ServerLogitsKD:
    """A loss term: alpha · KD(the client's logits ‖ the server's logits for the batch's
    samples), once server logits came down with the task (`download["logits"]`, (n,
    classes)); nothing before (a client's first round)."""

    alpha: float
    temperature: float

    vectorises = "it reads per-sample server logits by the batch's sample indices"

    def __call__(
        self, outputs: torch.Tensor, y: torch.Tensor, per_sample: torch.Tensor, ctx: TrainContext
    ) -> torch.Tensor | None:
        teacher = ctx.task.download.get("logits")
        if teacher is None or ctx.indices is None:
            return None
        rows = teacher[ctx.indices.to(teacher.device)].to(outputs.device)  # (B, classes)
        return self.alpha * kd_loss(outputs, rows, self.temperature)


@dataclass(frozen=True)
class FeatureUpload:
    """After training, the client's whole training set in index order, in batches of the
    task's batch size through its model in eval mode (`model(x, activations=True)` ->
    (feature map, logits)), as FedML's client extracts them after its epochs: the upload
    `UPLOAD_NAMES`; each batch is recorded as a forward pass."""

    vectorises = "it runs a pass over the client's whole training set after training"

    def __call__(self, model: ModelCall, data: ClientData, ctx: TrainContext) -> State:
        features, logits = [], []
        size = ctx.settings.batch_size
        for start in range(0, data.n_train, size):
            x = model_inputs(data.x_train[start : start + size], data.pixels)
            z, out = model(x, activations=True)  # type: ignore[misc]
            features.append(z.detach())
            logits.append(out.detach())
            ctx.passes.append(PassRecord(ctx.task.spec, "forward", int(x.shape[0]), 1))
        return {
            "features": torch.cat(features),
            "logits": torch.cat(logits),
            "labels": data.y_train.clone(),
            "indices": torch.arange(data.n_train),
        }
