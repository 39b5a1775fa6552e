"""The detection sets a run's `data.dataset` can name, and the client groups built from one.

A detection set is not a classification `Dataset` (its labels are boxes), so it has a
registry of its own beside `DATASETS`: `DETECTION_DATASETS` maps a name to a loader of a
`DetectionSet` sized for the run's groups (`DetectionNeeds`). The clients are
`hetfl.data.detection_views.detection_clients`' (IID shares, each group at its side and
its first K classes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hetfl.core.registry import Registry
from hetfl.data.detection import DetectionSet
from hetfl.data.detection_views import DetectionGroup
from hetfl.data.synthetic_detection import synthetic_detection
from hetfl.data.voc import load_voc


@dataclass(frozen=True)
class DetectionNeeds:
    """What a run asks of a detection set: its groups, the training images per client
    (`data.groups[].samples`) and the test images per client (`data.test_per_client`)
    where the source draws them, the data path, the seed."""

    groups: tuple[DetectionGroup, ...]
    samples: int | None
    test_per_client: int
    path: str | None
    seed: int

    @property
    def side(self) -> int:
        """The largest group side: the set is made once at it and resized down per group."""
        return max(g.side for g in self.groups)

    @property
    def clients(self) -> int:
        return sum(g.clients for g in self.groups)


DETECTION_DATASETS = Registry[Callable[[DetectionNeeds], DetectionSet]]("detection dataset")
#: The sets drawn to size, which need `samples`; the others are dealt whole and refuse it.
DRAWN = ("synthetic-detection",)


def check_samples(name: str, samples: int | None) -> None:
    """ValueError unless `samples` is given exactly for a set drawn to size (`DRAWN`)."""
    if name in DRAWN and samples is None:
        raise ValueError(
            f"{name} draws its scenes: give each group its training scenes per client, "
            "data.groups[].samples"
        )
    if name not in DRAWN and samples is not None:
        raise ValueError(
            f"{name} deals its whole training set to the clients: leave data.groups[].samples out"
        )


@DETECTION_DATASETS.decorator("synthetic-detection")
def _synthetic(needs: DetectionNeeds) -> DetectionSet:
    """Scenes at the largest group side, of as many classes as the widest group detects,
    `samples` training and `test_per_client` test scenes per client (the run's seed)."""
    check_samples("synthetic-detection", needs.samples)
    assert needs.samples is not None
    return synthetic_detection(
        n_train=needs.samples * needs.clients,
        n_test=needs.test_per_client * needs.clients,
        num_classes=max(g.classes for g in needs.groups),
        side=needs.side,
        seed=needs.seed,
    )


@DETECTION_DATASETS.decorator("voc2007")
def _voc2007(needs: DetectionNeeds) -> DetectionSet:
    """VOC 2007 trainval/test at the largest group side, dealt whole to the clients."""
    check_samples("voc2007", needs.samples)
    return load_voc(needs.path, "2007", side=needs.side)
