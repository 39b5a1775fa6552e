"""Datasets, partitioners and the clients' tensors.

`DATASETS` and `PARTITIONERS` are the registries behind config validation (and, through
the torch-free copy in `hetfl.catalogue`, `hetfl list`);
`build_clients` turns a dataset and a partition into the `ClientData` the engines use.
The data layer knows no model.
"""

from hetfl.data.cifar import load_cifar10, load_cifar100
from hetfl.data.cinic10 import load_cinic10
from hetfl.data.dataset import DATASETS, OWNED_DATASETS, Dataset, stratified_split
from hetfl.data.digits import load_digits
from hetfl.data.fashion_mnist import load_fashion_mnist, read_idx
from hetfl.data.federation import (
    build_clients,
    global_test,
    local_test_indices,
    validation_split,
)
from hetfl.data.ham10000 import SPLITS as HAM10000_SPLITS
from hetfl.data.ham10000 import load_ham10000
from hetfl.data.leaf import LEAF_DATASETS, load_femnist, load_shakespeare
from hetfl.data.libsvm import load_libsvm, read_libsvm
from hetfl.data.locate import DatasetNotFoundError
from hetfl.data.npz import load_npz
from hetfl.data.partition import (
    PARTITIONERS,
    PartitionError,
    class_counts,
    dirichlet,
    format_class_table,
    iid,
    k_classes,
    quantity_skew,
)
from hetfl.data.pydoc_topics import load_pydoc_topics
from hetfl.data.synthetic import load_synthetic
from hetfl.data.tiny_imagenet import load_tiny_imagenet
from hetfl.data.wikitext2 import load_wikitext2

#: The test splits a dataset can draw (`data.split`), by dataset; the first is the default.
DATASET_SPLITS: dict[str, tuple[str, ...]] = {"ham10000": HAM10000_SPLITS}

__all__ = [
    "DATASETS",
    "DATASET_SPLITS",
    "LEAF_DATASETS",
    "OWNED_DATASETS",
    "PARTITIONERS",
    "Dataset",
    "DatasetNotFoundError",
    "PartitionError",
    "build_clients",
    "class_counts",
    "dirichlet",
    "format_class_table",
    "global_test",
    "iid",
    "k_classes",
    "load_cifar10",
    "load_cifar100",
    "load_cinic10",
    "load_digits",
    "load_fashion_mnist",
    "load_femnist",
    "load_ham10000",
    "load_libsvm",
    "load_npz",
    "load_pydoc_topics",
    "load_shakespeare",
    "load_synthetic",
    "load_tiny_imagenet",
    "load_wikitext2",
    "local_test_indices",
    "quantity_skew",
    "read_idx",
    "read_libsvm",
    "stratified_split",
    "validation_split",
]
