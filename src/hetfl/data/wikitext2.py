"""One job: WikiText-2 (Merity et al., "Pointer Sentinel Mixture Models", ICLR 2017, §4.2)
from its official archive, the corpus of FedFA's Transformer runs (Park and Joe-Wong,
ECML-PKDD 2024, §5 and Table 3).

The archive `wikitext-2-v1.zip` (the tokenised version, which torchtext's `WikiText2`
and the common language-model examples read) extracts to

    wikitext-2/wiki.train.tokens   600 Wikipedia articles
    wikitext-2/wiki.valid.tokens   60 articles
    wikitext-2/wiki.test.tokens    60 articles

plain UTF-8 text, one paragraph or heading a line, out-of-vocabulary words already `<unk>`.
An article starts at a top-level heading, a line ` = Title = ` (one `=` each side; ` = =
Section = = ` lines are its sections). HetFL reads the training and test files (the
validation file is the authors' split for model selection; `data.validation` draws one
from training instead, as for every dataset), tokenises them by bytes
(`hetfl.data.byte_tokens`) and gives each training sample its article as owner
(`train_groups`), so the `natural` partition is non-IID by source document.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from hetfl.data.archives import ARCHIVES, find_extracted
from hetfl.data.byte_tokens import CONTEXT, VOCABULARY, encode, grouped_samples
from hetfl.data.dataset import DATASETS, Dataset

ARCHIVE = ARCHIVES["wikitext2"]
SPLIT_FILES = {
    "train": "wiki.train.tokens",
    "valid": "wiki.valid.tokens",
    "test": "wiki.test.tokens",
}
#: A top-level heading: ` = Title = `, one `=` each side.
_ARTICLE = re.compile(r"^ = [^=].* = $")


def articles(text: str) -> list[str]:
    """The articles of a WikiText file, each from its top-level heading to the next; the
    blank line each file starts with belongs to the first."""
    out: list[list[str]] = [[]]
    headed = False
    for line in text.splitlines(keepends=True):
        heading = bool(_ARTICLE.match(line.rstrip("\n")))
        if heading and headed:
            out.append([])
        headed |= heading
        out[-1].append(line)
    return ["".join(lines) for lines in out]


def _read(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    path = folder / SPLIT_FILES[split]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); is it WikiText-2's file?") from None
    documents = [encode(a) for a in articles(text)]
    x, y, group = grouped_samples(documents, CONTEXT)
    if y.size == 0:
        raise ValueError(f"{path}: no text longer than {CONTEXT} bytes; is it WikiText-2's file?")
    return x, y, group


@DATASETS.decorator("wikitext2")
def load_wikitext2(path: str | Path | None = None) -> Dataset:
    """WikiText-2: int64 (N, 32) byte contexts, the next byte as label (256 classes),
    `train_groups` = article; `path` is the folder holding `wikitext-2/` (or that folder),
    default `$HETFL_DATA` then the download cache (`hetfl data download wikitext2`)."""
    folder = find_extracted(path, ARCHIVE, (SPLIT_FILES["train"], SPLIT_FILES["test"]))
    x_train, y_train, group = _read(folder, "train")
    x_test, y_test, _ = _read(folder, "test")
    train, test = folder / SPLIT_FILES["train"], folder / SPLIT_FILES["test"]
    return Dataset(
        "wikitext2",
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=VOCABULARY,
        files={"x_train": train, "y_train": train, "x_test": test, "y_test": test},
        train_groups=group,
    )
