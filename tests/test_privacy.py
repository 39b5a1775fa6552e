"""The split-learning privacy measures on small batches, by hand: the biased sample distance
correlation and patch shuffling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hetfl.core.client.privacy import distance_correlation, shuffle_patches


def test_distance_correlation_of_a_three_sample_batch_by_hand():
    # x = (0, 1, 2), z = (0, 1, 0): double-centred distances A, B (in ninths)
    # A = [[-10, 2, 8], [2, -4, 2], [8, 2, -10]], B = [[-2, 4, -2], [4, -8, 4], [-2, 4, -2]]
    # sum AB = 72, sum AA = 360, sum BB = 144 -> dCor² = 72 / sqrt(360 x 144) = 1 / sqrt(10)
    x = torch.tensor([[0.0], [1.0], [2.0]])
    z = torch.tensor([[0.0], [1.0], [0.0]])
    assert float(distance_correlation(x, z)) == pytest.approx(10**-0.25, rel=1e-6)


def test_distance_correlation_is_one_for_a_similarity_and_flattens_samples():
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(0))
    assert float(distance_correlation(x, 3 * x + 1)) == pytest.approx(1.0, rel=1e-6)


def _slow_dcor(x: list[list[float]], z: list[list[float]]) -> float:
    """The definition, term by term in Python floats."""
    n = len(x)

    def centred(v):
        d = [[math.dist(v[j], v[k]) for k in range(n)] for j in range(n)]
        row = [sum(r) / n for r in d]
        col = [sum(d[j][k] for j in range(n)) / n for k in range(n)]
        grand = sum(row) / n
        return [[d[j][k] - row[j] - col[k] + grand for k in range(n)] for j in range(n)]

    a, b = centred(x), centred(z)
    pairs = list(itertools.product(range(n), range(n)))
    ab = sum(a[j][k] * b[j][k] for j, k in pairs) / n**2
    aa = sum(a[j][k] ** 2 for j, k in pairs) / n**2
    bb = sum(b[j][k] ** 2 for j, k in pairs) / n**2
    return math.sqrt(ab / math.sqrt(aa * bb))


def test_distance_correlation_matches_the_definition_on_a_random_batch():
    # 30 samples: past 25, cdist's default takes distances from matrix products, which
    # cancel to about 1e-8; the definition's exact distances are kept
    g = torch.Generator().manual_seed(1)
    x, z = torch.randn(30, 4, generator=g, dtype=torch.float64), torch.randn(30, 3, generator=g)
    z = z.double() + x[:, :3]  # related, not equal
    got = distance_correlation(x, z).item()
    assert got == pytest.approx(_slow_dcor(x.tolist(), z.tolist()), rel=1e-12)


def test_distance_correlation_has_finite_gradients_with_repeated_samples_and_none_to_spare():
    x = torch.tensor([[0.0, 1.0], [0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])
    z = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)
    distance_correlation(x, z).backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
    one = torch.ones(1, 3, requires_grad=True)  # one sample: no spread, 0
    value = distance_correlation(torch.ones(1, 2), one)
    value.backward()
    assert value.item() == 0.0 and one.grad is not None
    with pytest.raises(ValueError, match="same samples"):
        distance_correlation(torch.ones(2, 1), torch.ones(3, 1))


def test_patch_shuffling_moves_whole_patches_in_one_order_for_the_batch():
    z = torch.arange(2 * 2 * 4 * 4, dtype=torch.float32).reshape(2, 2, 4, 4)
    order = torch.randperm(4, generator=torch.Generator().manual_seed(5)).tolist()
    out = shuffle_patches(z, 2, torch.Generator().manual_seed(5))
    corners = [(0, 0), (0, 2), (2, 0), (2, 2)]  # the 2x2 patches, row by row
    for position, source in enumerate(order):
        (r, c), (sr, sc) = corners[position], corners[source]
        # every sample and channel: patch `source` now sits at `position`
        assert torch.equal(out[:, :, r : r + 2, c : c + 2], z[:, :, sr : sr + 2, sc : sc + 2])
    assert order != [0, 1, 2, 3]  # this seed does move them
    assert torch.equal(out.flatten().sort().values, z.flatten())  # nothing lost or made


def test_patch_shuffling_draws_a_new_order_per_batch_and_refuses_ragged_patches():
    g = torch.Generator().manual_seed(0)
    z = torch.arange(36.0).reshape(1, 1, 6, 6)
    first, second = shuffle_patches(z, 2, g), shuffle_patches(z, 2, g)
    assert not torch.equal(first, second)
    assert torch.equal(shuffle_patches(z, 6, g), z)  # one patch: nothing to shuffle
    with pytest.raises(ValueError, match="patch size 4 does not tile activations of 6x6"):
        shuffle_patches(z, 4, g)
    with pytest.raises(ValueError, match=r"takes activations \(B, C, H, W\)"):
        shuffle_patches(torch.ones(2, 6), 2, g)
