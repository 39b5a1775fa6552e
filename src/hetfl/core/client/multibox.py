"""SSD's training objective as a forward part, and its detections for scoring.

Liu et al., "SSD: Single Shot MultiBox Detector", ECCV 2016, §2.2:

- matching: every ground-truth box takes the default box it overlaps most, then every
  default box takes the ground truth it overlaps by IoU above 0.5 (the best one);
- loss L = (L_conf + alpha L_loc) / N over the N matched (positive) default boxes, L = 0
  when N = 0; alpha = 1;
- L_loc: smooth L1 between the predicted offsets and the positive's encoded ground truth,
  g_cx = (cx - d_cx) / d_w, g_cy = (cy - d_cy) / d_h, g_w = log(w / d_w), g_h = log(h /
  d_h) (equation 2);
- L_conf: softmax cross-entropy over K + 1 classes (background 0) of the positives and of
  the negatives hard-negative mining keeps: per image, the unmatched default boxes of the
  highest background loss, at most 3 per positive (§2.2, "Hard negative mining").

Deviation, named: the offsets are divided by the "variances" 0.1 (centre) and 0.2 (size)
of the authors' released code (`prior_box_layer`), which eq. 2 does not show; set
`variances=(1, 1)` for the equation as printed. Objects flagged difficult are trained on.

The loop takes the batch's mean of a per-sample loss; the per-sample loss here is
B (L_conf,i + alpha L_loc,i) / N, so that its mean is the batch's L.

The default boxes come from the model family (`hetfl.models.ssd.default_boxes`), given as
a function of the task's spec: the client half imports no model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hetfl.core.boxes import PAD_LABEL, box_iou, centres, corners, nms
from hetfl.core.client.average_precision import Detections
from hetfl.core.client.recipe import ModelCall, TrainContext
from hetfl.core.spec import Spec

#: Default boxes (A, 4) of a spec, in the order of the model's outputs.
Priors = Callable[[Spec], torch.Tensor]


def encode(
    boxes: torch.Tensor, priors: torch.Tensor, variances: tuple[float, float]
) -> torch.Tensor:
    """Corner boxes (..., A, 4) as offsets from the priors (A, 4) (SSD eq. 2, over the
    variances)."""
    g, d = centres(boxes), centres(priors)
    centre = (g[..., :2] - d[..., :2]) / d[..., 2:] / variances[0]
    size = torch.log(g[..., 2:].clamp(min=1e-6) / d[..., 2:]) / variances[1]
    return torch.cat([centre, size], dim=-1)


def decode(
    offsets: torch.Tensor, priors: torch.Tensor, variances: tuple[float, float]
) -> torch.Tensor:
    """The inverse of `encode`: corner boxes (..., A, 4) from offsets and priors."""
    d = centres(priors)
    centre = d[..., :2] + offsets[..., :2] * variances[0] * d[..., 2:]
    size = d[..., 2:] * torch.exp(offsets[..., 2:] * variances[1])
    return corners(torch.cat([centre, size], dim=-1))


def match(
    priors: torch.Tensor, targets: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(class per prior (B, A): 0 background, k + 1 for label k; the matched box per prior
    (B, A, 4)) of targets (B, M, 6) (SSD §2.2, "Matching strategy")."""
    labels, boxes = targets[..., 0].long(), targets[..., 1:5]
    real = labels != PAD_LABEL  # (B, M)
    iou = box_iou(priors[None], boxes)  # (B, A, M)
    iou = iou.masked_fill(~real[:, None, :], -1.0)
    best_iou, best_gt = iou.max(dim=2)  # (B, A)
    best_prior = iou.argmax(dim=1)  # (B, M)
    rows = torch.arange(targets.shape[0])
    for m in range(targets.shape[1]):  # each object keeps its best prior (later ones win)
        forced = real[:, m]
        best_gt[rows[forced], best_prior[forced, m]] = m
        best_iou[rows[forced], best_prior[forced, m]] = 2.0
    matched = torch.gather(labels, 1, best_gt) + 1  # (B, A)
    classes = torch.where(best_iou > threshold, matched, torch.zeros_like(matched))
    gt_boxes = torch.gather(boxes, 1, best_gt[..., None].expand(-1, -1, 4))  # (B, A, 4)
    return classes, gt_boxes


@dataclass(frozen=True)
class MultiBoxLoss:
    """A forward (`hetfl.core.client.recipe.Forward`): the model's (B, A, 4 + K + 1)
    outputs and SSD's per-sample loss (module docstring) against targets (B, M, 6)."""

    vectorises: ClassVar[str] = (
        "SSD's matching and hard-negative mining rank default boxes per batch"
    )
    priors: Priors
    threshold: float = 0.5
    negatives_per_positive: int = 3
    alpha: float = 1.0
    variances: tuple[float, float] = (0.1, 0.2)

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"the matching threshold must be in (0, 1), got {self.threshold}")
        if self.negatives_per_positive < 0 or self.alpha < 0:
            raise ValueError(
                "negatives_per_positive and alpha must be >= 0, got "
                f"{self.negatives_per_positive} and {self.alpha}"
            )

    def __call__(
        self, model: ModelCall, x: torch.Tensor, y: torch.Tensor, ctx: TrainContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = model(x)
        priors = ctx.constant(self, "priors", lambda: self.priors(ctx.task.spec).to(x.device))
        return outputs, self.per_sample(outputs, y, priors)

    def per_sample(
        self, outputs: torch.Tensor, targets: torch.Tensor, priors: torch.Tensor
    ) -> torch.Tensor:
        """(B,) losses whose mean is SSD's L for the batch."""
        if outputs.shape[1] != priors.shape[0]:
            raise ValueError(
                f"the model scores {outputs.shape[1]} default boxes but its spec has "
                f"{priors.shape[0]}"
            )
        classes, gt_boxes = match(priors, targets, self.threshold)
        positive = classes > 0  # (B, A)
        offsets, logits = outputs[..., :4], outputs[..., 4:]
        conf = F.cross_entropy(logits.transpose(1, 2), classes, reduction="none")  # (B, A)
        # hard negatives: the unmatched boxes of highest loss, at most 3 per positive
        ranked = conf.detach().masked_fill(positive, -1.0)
        order = ranked.argsort(dim=1, descending=True, stable=True)
        rank = order.argsort(dim=1)
        wanted = (self.negatives_per_positive * positive.sum(dim=1, keepdim=True)).clamp(
            max=int(positive.shape[1])
        )
        negative = ~positive & (rank < wanted)
        conf_i = (conf * (positive | negative)).sum(dim=1)
        loc = F.smooth_l1_loss(
            offsets, encode(gt_boxes, priors, self.variances), reduction="none"
        ).sum(dim=2)
        loc_i = (loc * positive).sum(dim=1)
        n = positive.sum().clamp(min=1)
        return targets.shape[0] * (conf_i + self.alpha * loc_i) / n


def detections(
    outputs: torch.Tensor,
    priors: torch.Tensor,
    *,
    score_threshold: float = 0.03,
    nms_threshold: float = 0.45,
    top_k: int = 200,
    variances: tuple[float, float] = (0.1, 0.2),
) -> list[Detections]:
    """Each image's detections from (B, A, 4 + K + 1) outputs: per class, the boxes of
    softmax score above `score_threshold`, suppressed at `nms_threshold`, then the
    `top_k` best of all classes (ScalableFL's Table IX: 0.03, 0.45, 200; SSD §3.7).
    Labels are 0..K-1 (background dropped)."""
    probs = outputs[..., 4:].softmax(dim=-1)  # (B, A, K + 1)
    boxes = decode(outputs[..., :4], priors, variances).clamp(0, 1)  # (B, A, 4)
    out = []
    for b in range(outputs.shape[0]):
        kept_boxes, kept_scores, kept_labels = [], [], []
        for k in range(1, probs.shape[2]):
            scores = probs[b, :, k]
            keep = torch.nonzero(scores > score_threshold).flatten()
            if keep.numel() == 0:
                continue
            best = keep[nms(boxes[b, keep], scores[keep], nms_threshold)]
            kept_boxes.append(boxes[b, best])
            kept_scores.append(scores[best])
            kept_labels.append(torch.full((best.numel(),), k - 1, dtype=torch.long))
        if not kept_scores:
            empty = outputs.new_zeros((0,))
            out.append(Detections(outputs.new_zeros((0, 4)), empty, empty.long()))
            continue
        scores = torch.cat(kept_scores)
        top = torch.argsort(scores, descending=True, stable=True)[:top_k]
        out.append(Detections(torch.cat(kept_boxes)[top], scores[top], torch.cat(kept_labels)[top]))
    return out
