"""The text datasets: byte tokens and next-token samples by hand, the standard library's
topic texts split by document, and WikiText-2 downloaded from a zip archive in the
official layout served from 127.0.0.1, verified, extracted and read by article."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pydoc_data.topics import topics

import numpy as np
import pytest

from hetfl.data import PARTITIONERS, DatasetNotFoundError, load_pydoc_topics, load_wikitext2
from hetfl.data.archives import ARCHIVE_MD5
from hetfl.data.byte_tokens import encode, grouped_samples, next_token_samples
from hetfl.data.download import DOWNLOADERS
from hetfl.data.fetch import DownloadError
from hetfl.data.wikitext2 import articles
from local_mirror import LocalMirror


def test_bytes_are_tokens_and_contexts_tile_the_text_without_overlap() -> None:
    codes = encode("abcdefghij")  # 10 bytes: contexts "abc", "def", "ghi"; labels d, g, j
    x, y = next_token_samples(codes, 3)
    assert x.tolist() == [[97, 98, 99], [100, 101, 102], [103, 104, 105]]
    assert y.tolist() == [100, 103, 106]
    assert x.dtype == y.dtype == np.int64
    assert encode("é").tolist() == [0xC3, 0xA9]  # UTF-8: two tokens, no unknown token
    assert next_token_samples(encode("abc"), 3)[1].size == 0  # no token after the context
    with pytest.raises(ValueError, match="context must be at least 1"):
        next_token_samples(codes, 0)


def test_grouped_samples_name_each_samples_document() -> None:
    x, y, group = grouped_samples([encode("abcde"), encode("xy"), encode("0123456")], 2)
    assert y.tolist() == [ord("c"), ord("e"), ord("2"), ord("4"), ord("6")]
    assert group.tolist() == [0, 0, 2, 2, 2] and x.shape == (5, 2)


def test_pydoc_topics_hold_each_documents_tail_out_for_test_and_deal_documents() -> None:
    ds = load_pydoc_topics()
    assert ds.num_classes == 256 and ds.input_shape == (32,)
    first = encode(topics[sorted(topics)[0]])
    x, y = next_token_samples(first, 32)
    held = int(np.ceil(0.1 * len(y)))
    n_first = int((ds.train_groups == 0).sum())
    assert n_first == len(y) - held
    np.testing.assert_array_equal(ds.x_train[:n_first], x[: len(y) - held])
    np.testing.assert_array_equal(ds.x_test[:held], x[len(y) - held :])
    parts = PARTITIONERS.get("natural")(
        ds.y_train, 4, np.random.default_rng(0), groups=ds.train_groups
    )
    owners = [set(ds.train_groups[p].tolist()) for p in parts]
    assert all(len(o) == 1 for o in owners) and len(set().union(*owners)) == 4


def _wikitext(train: str, test: str) -> bytes:
    """`wikitext-2-v1.zip` as published: one folder, the three token files."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("wikitext-2/", "")
        for split, text in (("train", train), ("valid", " = V = \n"), ("test", test)):
            zf.writestr(f"wikitext-2/wiki.{split}.tokens", text)
    return buffer.getvalue()


TRAIN = " \n = Alpha = \n \n a b c <unk> d e f g h i j k l m n o p q r s t u v w \n" + (
    " = = Section = = \n x y z . \n = Beta = \n the beta article , with more words than 32 .\n"
)


def test_articles_start_at_top_level_headings_only() -> None:
    parts = articles(TRAIN)
    assert len(parts) == 2 and "".join(parts) == TRAIN
    assert parts[0].startswith(" \n = Alpha = \n") and "= = Section = =" in parts[0]
    assert parts[1].startswith(" = Beta = \n")


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    srv = LocalMirror(tmp_path_factory.mktemp("mirror"))
    yield srv
    srv.close()


def test_wikitext2_downloads_verifies_extracts_and_loads_by_article(
    mirror, tmp_path, monkeypatch
) -> None:
    test_text = " = Gamma = \n the test article has its own words , enough for samples .\n"
    archive = _wikitext(TRAIN, test_text)
    (mirror.root / "wt").mkdir()
    (mirror.root / "wt" / "wikitext-2-v1.zip").write_bytes(archive)
    digest = hashlib.md5(archive, usedforsecurity=False).hexdigest()
    monkeypatch.setitem(ARCHIVE_MD5, "wikitext-2-v1.zip", digest)
    dest = DOWNLOADERS["wikitext2"](tmp_path / "w", mirror.mirror("wt"))
    assert sorted(p.name for p in dest.iterdir()) == ["wikitext-2", "wikitext-2-v1.zip"]

    ds = load_wikitext2(dest)
    alpha, beta = (encode(a) for a in articles(TRAIN))
    xa, ya = next_token_samples(alpha, 32)
    xb, yb = next_token_samples(beta, 32)
    np.testing.assert_array_equal(ds.x_train, np.concatenate([xa, xb]))
    np.testing.assert_array_equal(ds.y_train, np.concatenate([ya, yb]))
    assert ds.train_groups.tolist() == [0] * len(ya) + [1] * len(yb)
    np.testing.assert_array_equal(ds.y_test, next_token_samples(encode(test_text), 32)[1])
    assert ds.num_classes == 256 and ds.files["x_test"].name == "wiki.test.tokens"


def test_wikitext2_with_a_wrong_archive_or_none_says_so(mirror, tmp_path, monkeypatch) -> None:
    (mirror.root / "bad").mkdir()
    (mirror.root / "bad" / "wikitext-2-v1.zip").write_bytes(_wikitext(TRAIN, TRAIN))
    with pytest.raises(DownloadError, match="MD5 mismatch"):  # the real MD5 is kept
        DOWNLOADERS["wikitext2"](tmp_path / "w", mirror.mirror("bad"))
    monkeypatch.delenv("HETFL_DATA", raising=False)
    monkeypatch.setenv("HETFL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DatasetNotFoundError, match="hetfl data download wikitext2"):
        load_wikitext2()
