"""What `hetfl list` prints: every registered name, with its one-line summary where the
registry has one, in a module that imports nothing.

The registries (`hetfl.algorithms.ALGORITHMS`, `hetfl.models.MODELS`, `ARCHITECTURES`,
`COMPOSED` and `SPLIT`, `hetfl.data.DATASETS` and `PARTITIONERS`,
`hetfl.core.server.reducers.REDUCERS`,
`hetfl.core.client.wrappers.WRAPPERS`) are filled by importing the modules that build
each entry, and those import torch: seconds of start-up for a command that only names
things. This catalogue names them at no import cost. The summary of an algorithm, a reducer
kind or a client-program wrapper is written only here (its registration reads it, and
refuses a name missing here); the registries remain what runs and validates, and
tests/test_startup.py asserts that this catalogue equals them entry for entry, so an entry
added or renamed in one place only fails the tests.

It names HetFL's own entries only: a plugin's (docs/plugins.md) carry their summaries with
them, and `hetfl list --plugin MODULE` lists them from the registries (`hetfl.listing`).
"""

from __future__ import annotations

ALGORITHMS: dict[str, str] = {
    "ada-fedalrc": "Ada-FedALRC (Wei et al. 2024): FedALRC local training, Adagrad server step",
    "dtfl": (
        "DTFL (dynamic tiering): tiers of a split model, local-loss training, "
        "a scheduler on simulated times"
    ),
    "fedadagrad": "FedAdagrad (Reddi et al. 2021): Adagrad server step",
    "fedadam": "FedAdam (Reddi et al. 2021): Adam server step, no bias correction",
    "fedalrc": (
        "FedALRC (Wei et al. 2024): local Rademacher regularisation, FedNova steps x gamma"
    ),
    "fedavg": "FedAvg (McMahan et al. 2017): sample-weighted averaging",
    "fedfa": (
        "FedFA (Park and Joe-Wong 2024): clients of different widths and depths, layer "
        "grafting, scalable aggregation"
    ),
    "fedbn": "FedBN (Li et al. 2021): private normalisation layers",
    "fedgkt": (
        "FedGKT (He et al. 2020): small client models distilled with a large server model "
        "trained on uploaded features"
    ),
    "fednova": "FedNova (Wang et al. 2020): normalised averaging of local updates",
    "fedper": "FedPer (Arivazhagan et al. 2019): a private head",
    "fedprox": "FedProx (Li et al. 2020): FedAvg with a proximal term",
    "fedyogi": "FedYogi (Reddi et al. 2021): Yogi server step",
    "fjord": "FjORD (Horváth et al. 2021): ordered dropout, a width per mini-batch",
    "flanc": (
        "FLANC (Mei et al. 2022): kernels composed from shared bases and per-capacity coefficients"
    ),
    "flexifed": (
        "FlexiFed (Wang et al. 2023): depth-only architectures, Max-Common layers averaged "
        "per shared prefix"
    ),
    "flexlora": (
        "FlexLoRA (Bai et al. 2024): LoRA of several ranks, Σ w_k B_k A_k by SVD, each "
        "client its rank's truncation"
    ),
    "flora": (
        "FLoRA (Wang et al. 2024): LoRA of several ranks, factors stacked into the exact "
        "sum, merged into every client's base"
    ),
    "heterofl": "HeteroFL (Diao et al. 2021): width levels of one model, static BN, label split",
    "hetlora": (
        "HetLoRA (Cho et al. 2024): LoRA of several ranks, zero-padded sparsity-weighted averaging"
    ),
    "local-only": "each client trains alone; nothing is shared",
    "nefl": (
        "NeFL (Kang et al. 2023): nested width and depth sub-models with step sizes, "
        "BN and steps per sub-model"
    ),
    "scalablefl": (
        "ScalableFL (Nitta et al. 2023): depth from input size, width from classes, "
        "private BN and heads"
    ),
    "splitfed": (
        "SplitFed SFLV1 (Thapa et al. 2022): one cut, a server copy per client, "
        "gradients sent back every batch"
    ),
}

MODELS: tuple[str, ...] = ("char-lstm", "lenet5", "linear", "mlp", "small-cnn", "vgg11")

ARCHITECTURES: dict[str, str] = {
    "efficientnetv2-s": (
        "EfficientNetV2-S (Tan and Le 2021, Table 4): widths per stage, depth by repeats (FedFA)"
    ),
    "efficientnetv2-tiny": (
        "EfficientNetV2-S's stages at 1/4 of the channels, at most 3 repeats (CPU-sized)"
    ),
    "flanc-cnn": "FLANC's Fashion-MNIST CNN (64, 128, 128)",
    "mobilenetv2": "MobileNetV2 (Sandler et al. 2018): widths per stage, depth by repeats (FedFA)",
    "preresnet": "Pre-activation ResNet with sections of blocks (HeteroFL, FedFA, NeFL)",
    "resnet18": "ResNet-18, post-activation, stages x blocks (ScalableFL Table IV)",
    "ssd-stage-cnn": "SSD heads on ScalableFL's stage CNN (object detection)",
    "stage-cnn": "ScalableFL's stage CNN (32-256 ch)",
    "transformer": (
        "Transformer LM, 8 heads x 32, MLP 2x, 4 layers: width by heads, depth by layers "
        "(FedFA Table 3)"
    ),
    "transformer-tiny": (
        "Transformer LM, 4 heads x 8, MLP 2x, 2 layers: width by heads, depth by layers "
        "(FedFA Table 3)"
    ),
}

COMPOSED: dict[str, str] = {
    "composed-cnn": "FLANC's Fashion-MNIST CNN, composed convolutions (basis: table2 | code)",
    "composed-resnet18": (
        "FLANC's ResNet-18, composed 3x3 convolutions, BN per capacity (basis: code | table2)"
    ),
    "composed-rnn": "FLANC's character RNN (512), composed matrices",
}

SPLIT: dict[str, str] = {
    "resnet-cifar": (
        "DTFL's CIFAR bottleneck ResNet in modules md1..md8 (blocks 3: ResNet-56, 6: -110)"
    ),
}

DATASETS: tuple[str, ...] = (
    "cifar10",
    "cifar100",
    "cinic10",
    "digits",
    "fashion-mnist",
    "femnist",
    "ham10000",
    "libsvm",
    "npz",
    "pydoc-topics",
    "shakespeare",
    "synthetic",
    "tiny-imagenet",
    "wikitext2",
)

#: The detection sets (`hetfl.data.detection_sources.DETECTION_DATASETS`), for a detector.
DETECTION_DATASETS: tuple[str, ...] = ("synthetic-detection", "voc2007")

PARTITIONERS: tuple[str, ...] = ("classes", "dirichlet", "iid", "natural", "quantity")

#: Reducer kinds (`options.<method>.reducer: {kind: ..., ...}`; `hetfl.core.server.reducers`).
REDUCERS: dict[str, str] = {
    "mean": "the weighted mean, by the method's weighting (the default)",
    "median": "coordinate-wise median over the clients covering each element (Yin et al. 2018)",
    "trimmed-mean": (
        "coordinate-wise mean without the `trim` fraction at each end (Yin et al. 2018)"
    ),
    "coverage-krum": "the one client of lowest Krum score within cells of shared coverage",
    "coverage-multi-krum": "the `m` clients of lowest Krum score within cells, averaged",
    "coverage-median": (
        "coordinate-wise median, warning where attackers may be half an element's coverage"
    ),
    "coverage-trimmed-mean": (
        "coordinate-wise mean without min(ceil(fraction x n), k) values at each end"
    ),
    "norm-clip": "updates clipped to `bound` (or the round's median norm), then the mean",
    "trained-norm-clip": "norm-clip measured on what each client trained (each tensor once, "
    "before the method's scaling)",
    "krum": "the one client of lowest Krum score over shared elements (Blanchard et al. 2017)",
    "multi-krum": "the `m` clients of lowest Krum score, averaged (Blanchard et al. 2017)",
}

#: Client-program wrappers (`wrappers: [{kind: ..., ...}]`; `hetfl.core.client.wrappers`):
#: none built in (attacks are `ATTACKS`).
WRAPPERS: dict[str, str] = {}

#: Attacks (`attack: {kind: ..., fraction: ..., ...}`; `hetfl.attacks.registry`).
ATTACKS: dict[str, str] = {
    "fedfa-poison": "honest update + lambda x the update trained on shuffled labels (FedFA, Eq. 1)",
    "scaled-poison": "lambda x the update trained on shuffled labels, alone",
    "label-flip": "training labels of class `source` become `target`",
    "backdoor": "a pixel patch stamped on part of each batch, labelled `target` (BadNets)",
}
