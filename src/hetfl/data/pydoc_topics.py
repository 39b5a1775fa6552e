"""One job: the offline text corpus, the topic help texts the Python standard library ships
(`pydoc_data.topics.topics`, what `help("if")` prints), so language-model runs need no
download.

Each topic (79 in CPython 3.11, about 465,000 characters) is a source document and an
owner (`train_groups`), so the `natural` partition deals documents to clients, one
document each: non-IID by source document, as LEAF's Shakespeare deals speakers. Within
each document (sorted by topic name) the last tenth of its samples, at least one for a
document of two samples or more, is test data and the rest training data. Byte-level
tokens and next-token samples: `hetfl.data.byte_tokens`. The texts are those of the
interpreter that runs HetFL, so the corpus changes with the Python version; the run's
provenance records that version.
"""

from __future__ import annotations

import math
from pydoc_data.topics import topics

import numpy as np

from hetfl.data.byte_tokens import CONTEXT, VOCABULARY, encode, grouped_samples
from hetfl.data.dataset import DATASETS, Dataset

#: The share of each document's samples held out for test.
TEST_SHARE = 0.1


def split_by_document(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) sample indices: each document's last `TEST_SHARE` of samples
    (ceil, none for a one-sample document) to test."""
    test = []
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)
        held = math.ceil(TEST_SHARE * idx.size) if idx.size > 1 else 0
        test.append(idx[idx.size - held :])
    test_idx = np.sort(np.concatenate(test))
    return np.setdiff1d(np.arange(group.size), test_idx), test_idx


@DATASETS.decorator("pydoc-topics")
def load_pydoc_topics() -> Dataset:
    """The standard library's topic help texts: int64 (N, 32) byte contexts, the next
    byte as label (256 classes), `train_groups` = topic."""
    documents = [encode(topics[name]) for name in sorted(topics)]
    x, y, group = grouped_samples(documents, CONTEXT)
    train, test = split_by_document(group)
    return Dataset(
        "pydoc-topics",
        x[train],
        y[train],
        x[test],
        y[test],
        num_classes=VOCABULARY,
        train_groups=group[train],
    )
