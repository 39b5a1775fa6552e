"""mAP@0.5 against hand computations (VOC's rules: Everingham et al., IJCV 2010, §4.2)."""

from __future__ import annotations

import pytest
import torch

from hetfl.core.boxes import box_iou, nms
from hetfl.core.client.average_precision import (
    Detections,
    GroundTruth,
    average_precision,
    mean_average_precision,
)


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 4)


# one image, class 0: objects A, B (scored) and D (difficult), far apart
A, B, D = [0.0, 0.0, 0.2, 0.2], [0.5, 0.5, 0.7, 0.7], [0.0, 0.7, 0.2, 0.9]
TRUTH = GroundTruth(_t([A, B, D]), torch.tensor([0, 0, 0]), torch.tensor([False, False, True]))
# ranked 0.9 on A (TP), 0.85 on D (ignored), 0.8 nowhere (FP), 0.7 on B (TP), 0.5 on A again
DETECTIONS = Detections(
    _t([A, [0.3, 0.0, 0.4, 0.1], B, D, A]),
    torch.tensor([0.9, 0.8, 0.7, 0.85, 0.5]),
    torch.tensor([0, 0, 0, 0, 0]),
)


def test_the_two_interpolations_differ_on_a_hand_computed_case():
    # ranked: TP, (difficult: skipped), FP, TP, FP (A claimed already); 2 positives
    # precision 1, 1/2, 2/3, 1/2 at recall 1/2, 1/2, 1, 1
    # all-point: envelope 1 on (0, 1/2], 2/3 on (1/2, 1]: 1/2 + 1/3 = 5/6
    mean, per_class = mean_average_precision([DETECTIONS], [TRUTH], num_classes=1)
    assert mean == pytest.approx(5 / 6) and per_class == {0: pytest.approx(5 / 6)}
    # 11-point: 1 at r = 0 .. 0.5 (6 points), 2/3 at r = 0.6 .. 1 (5 points)
    eleven, _ = mean_average_precision(
        [DETECTIONS], [TRUTH], num_classes=1, interpolation="11-point"
    )
    assert eleven == pytest.approx((6 + 5 * 2 / 3) / 11)
    assert abs(eleven - mean) > 0.01


def test_difficult_objects_are_neither_rewarded_nor_penalised():
    # the same objects with D scored: D's detection is a TP and D a third positive
    # ranked TP, TP, FP, TP, FP: precision 1, 1, 2/3, 3/4, 3/5, recall 1/3, 2/3, 2/3, 1, 1
    scored = GroundTruth(TRUTH.boxes, TRUTH.labels, torch.zeros(3, dtype=torch.bool))
    mean, _ = mean_average_precision([DETECTIONS], [scored], num_classes=1)
    assert mean == pytest.approx(1 / 3 + 1 / 3 + 1 / 3 * 3 / 4)
    # and a missed difficult object costs nothing: without D's detection the AP is unchanged
    kept = [0, 1, 2, 4]
    missed = Detections(DETECTIONS.boxes[kept], DETECTIONS.scores[kept], DETECTIONS.labels[kept])
    assert mean_average_precision([missed], [TRUTH], 1)[0] == pytest.approx(5 / 6)


def test_classes_without_objects_are_skipped_and_a_wrong_class_is_a_false_positive():
    truth = GroundTruth(_t([A]), torch.tensor([1]), torch.tensor([False]))
    dets = Detections(_t([A, A]), torch.tensor([0.9, 0.8]), torch.tensor([0, 1]))
    mean, per_class = mean_average_precision([dets], [truth], num_classes=3)
    assert per_class == {1: pytest.approx(1.0)} and mean == pytest.approx(1.0)
    # below the threshold: a box overlapping A by IoU 0.5 exactly is not a match (strict >)
    whole, half = [0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.5, 0.25]  # exact in binary
    assert float(box_iou(_t([half]), _t([whole]))[0, 0]) == 0.5
    truth = GroundTruth(_t([whole]), torch.tensor([1]), torch.tensor([False]))
    dets = Detections(_t([half]), torch.tensor([0.9]), torch.tensor([1]))
    assert mean_average_precision([dets], [truth], 2)[0] == 0.0
    nothing = GroundTruth(_t([]), torch.tensor([]), torch.tensor([], dtype=torch.bool))
    assert mean_average_precision([dets], [nothing], 2)[0] is None


def test_two_images_rank_together():
    # image 1: A found at 0.4; image 2: B found at 0.9 and a false one at 0.6
    t1 = GroundTruth(_t([A]), torch.tensor([0]), torch.tensor([False]))
    t2 = GroundTruth(_t([B]), torch.tensor([0]), torch.tensor([False]))
    d1 = Detections(_t([A]), torch.tensor([0.4]), torch.tensor([0]))
    d2 = Detections(_t([B, A]), torch.tensor([0.9, 0.6]), torch.tensor([0, 0]))
    # ranked TP (0.9), FP (0.6), TP (0.4): precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1
    assert mean_average_precision([d1, d2], [t1, t2], 1)[0] == pytest.approx(5 / 6)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="interpolation must be one of"):
        average_precision(torch.ones(1), torch.ones(1), "101-point")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 images of detections but 2"):
        mean_average_precision([DETECTIONS], [TRUTH, TRUTH], 1)
    with pytest.raises(ValueError, match="iou_threshold"):
        mean_average_precision([DETECTIONS], [TRUTH], 1, iou_threshold=1.5)


def test_nms_keeps_the_best_of_overlapping_boxes():
    boxes = _t([A, [0.0, 0.0, 0.2, 0.19], B, [0.0, 0.0, 0.2, 0.15]])
    scores = torch.tensor([0.5, 0.9, 0.7, 0.8])
    # IoU(1, 0) = 0.95, IoU(1, 3) = 0.79 > 0.45: both suppressed by box 1
    assert nms(boxes, scores, 0.45).tolist() == [1, 2]
    assert nms(boxes, scores, 0.96).tolist() == [1, 3, 2, 0]
