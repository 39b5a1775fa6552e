"""What a split-learning client sends, made to reveal less of its data.

Two measures DTFL evaluates ("Speed up Federated Learning in Heterogeneous Environment: A
Dynamic Tiering Approach", §4.2 and Table 5), usable by any method whose clients send
activations:

- `distance_correlation(x, z)`: the biased sample distance correlation (Székely, Rizzo and
  Bakirov 2007; used as a loss by Vepakomma et al., "NoPeek", 2020) between a batch's
  inputs and the activations they produce; a client minimises (1 - alpha) CE + alpha DCor
  so that z says less about x. The authors' code (mahmoudsajjadi/DTFL `utils/loss.py`,
  `dis_corr`) centres squared distances; this is the definition, with Euclidean ones.
- `shuffle_patches(z, patch, generator)`: the activations' spatial patches in a random
  order (Yao et al., "Privacy-preserving split learning via patch shuffling over
  transformers", ICDM 2022), one permutation per batch applied to every sample, so the
  server cannot put the patches back together. Only what is sent is shuffled; the client's
  own head sees its activations in order.
"""

from __future__ import annotations

import torch


def _centred_distances(v: torch.Tensor) -> torch.Tensor:
    """(B, B) pairwise Euclidean distances of the rows of `v` (B, d), double-centred:
    a_jk - mean_j - mean_k + mean."""
    d = torch.cdist(v, v, compute_mode="donot_use_mm_for_euclid_dist")  # exact, zero diagonal
    return d - d.mean(dim=0, keepdim=True) - d.mean(dim=1, keepdim=True) + d.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The biased sample distance correlation of a batch, dCor_n(x, z) in [0, 1].

    Each sample of `x` (B, ...) and `z` (B, ...) is flattened to a vector; with A and B the
    double-centred distance matrices, dCov²_n = mean(A B), and
    dCor_n = sqrt(dCov²_n(x, z) / sqrt(dCov²_n(x, x) dCov²_n(z, z))), 0 when either side
    has no spread (a batch of one sample, constant inputs). Differentiable in both."""
    if x.shape[0] != z.shape[0]:
        raise ValueError(f"x and z must hold the same samples, got {x.shape[0]} and {z.shape[0]}")
    a = _centred_distances(x.reshape(x.shape[0], -1).to(z.dtype))
    b = _centred_distances(z.reshape(z.shape[0], -1))
    cov = (a * b).mean()
    spread = ((a * a).mean() * (b * b).mean()).sqrt()
    if float(spread.detach()) == 0.0:
        return cov * 0.0  # keeps the graph: a zero that still back-propagates
    return (cov / spread).clamp_min(0.0).sqrt()


def shuffle_patches(z: torch.Tensor, patch: int, generator: torch.Generator) -> torch.Tensor:
    """`z` (B, C, H, W) with its (H/patch)·(W/patch) spatial patches of patch x patch
    positions in an order drawn from `generator`, the same for every sample of the batch
    (a patch keeps its content and its channels). H and W must be multiples of `patch`."""
    if z.dim() != 4:
        raise ValueError(
            f"patch shuffling takes activations (B, C, H, W), got shape {tuple(z.shape)}"
        )
    b, c, h, w = z.shape
    if patch < 1 or h % patch or w % patch:
        raise ValueError(
            f"patch size {patch} does not tile activations of {h}x{w} positions; choose a "
            f"common divisor of {h} and {w}"
        )
    rows, cols = h // patch, w // patch
    # (B, C, rows, patch, cols, patch) -> (B, C, rows*cols, patch, patch): one entry per patch
    tiles = z.reshape(b, c, rows, patch, cols, patch).permute(0, 1, 2, 4, 3, 5)
    tiles = tiles.reshape(b, c, rows * cols, patch, patch)
    order = torch.randperm(rows * cols, generator=generator).to(z.device)
    tiles = tiles[:, :, order]
    back = tiles.reshape(b, c, rows, cols, patch, patch).permute(0, 1, 2, 4, 3, 5)
    return back.reshape(b, c, h, w)
