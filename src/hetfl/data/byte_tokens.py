"""One job: text to next-token samples, with the byte-level tokenizer the project ships.

A token is one byte of the text's UTF-8 encoding (256 tokens), as GPT-2's byte-level BPE
starts from before merging (Radford et al., "Language Models are Unsupervised Multitask
Learners", 2019, §2.2), without the merges. Why bytes: the tokenizer is 0 lines of
vocabulary to ship or download, every text encodes (no unknown token, the same for the
offline corpus and WikiText-2, whose test split has words its training split lacks), and
perplexity is per byte, comparable across corpora. The price is longer sequences than a
word or sub-word vocabulary for the same text.

A sample is a context of `context` tokens and the token after it (the label), as LEAF's
Shakespeare is (`hetfl.data.leaf`): contexts tile each document without overlap, so every
token but a document's first `context` is a label once per `context` positions. The mean
cross-entropy over samples is then the mean per-token cross-entropy of the labelled
tokens, whose exponential is the perplexity the metrics rows report.
"""

from __future__ import annotations

import numpy as np

#: Token codes 0..255: one per byte value.
VOCABULARY = 256
#: Tokens of context per sample, for the text datasets (CPU-sized).
CONTEXT = 32


def encode(text: str) -> np.ndarray:
    """The UTF-8 bytes of `text` as uint8 token codes."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def next_token_samples(codes: np.ndarray, context: int = CONTEXT) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): int64 (N, context) contexts tiling `codes` without overlap and the int64 (N,)
    token after each; N = (len(codes) - 1) // context, zero for a text no longer than
    `context`."""
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    n = (len(codes) - 1) // context
    x = codes[: n * context].reshape(n, context).astype(np.int64)
    y = codes[context : n * context + 1 : context].astype(np.int64)
    return x, y


def grouped_samples(
    documents: list[np.ndarray], context: int = CONTEXT
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, group): every document's samples in order, each with its document's index."""
    parts = [next_token_samples(d, context) for d in documents]
    x = np.concatenate([p[0] for p in parts]).reshape(-1, context)
    y = np.concatenate([p[1] for p in parts])
    group = np.concatenate([np.full(len(p[1]), i, dtype=np.int64) for i, p in enumerate(parts)])
    return x, y, group
