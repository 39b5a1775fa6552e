"""HetFL messages in Flower's records: the codec's header in a `ConfigRecord`, its tensors
in an `ArrayRecord`, and the message types of the adapter's exchanges.

Exchanges (server -> client, each answered once):

- `query.register`: who are you? The reply carries the node's partition id, its
  `ClientInfo` (with declared attributes) and the data settings it built its partition from.
- `train`: one `ClientTask` of a round; the reply carries the `ClientResult`.
- `evaluate`: one `EvalTask` (the client's model with its private layers on its local test
  split, or on its validation split as `EvalTask.split` says); the reply carries (correct,
  summed loss, count).
- `query.stats`: a static-BN statistics pass (HeteroFL) before global evaluation: an
  evaluated model's spec and complete tensors, and the number of training samples the node
  runs through it (`share`: all of them, or its share of `eval.stats_samples`, which it
  draws itself); the reply carries, per BatchNorm layer, the sums of the per-batch means
  and unbiased variances and the number of batches
  (`hetfl.engine.statistics.client_bn_statistics`).

Every request also carries the server's resolved config, so a node needs no state to
know the run it serves: a restarted node answers the next message like any other.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from hetfl.deploy.codec import CodecError, decode, encode

REGISTER = "query.register"
TRAIN = "train"
EVALUATE = "evaluate"
STATS = "query.stats"

_HEADER = "hetfl.header"
_TENSORS = "hetfl.tensors"


def to_content(value: Any) -> RecordDict:
    """A codec-encoded value as a Flower `RecordDict`."""
    header, tensors = encode(value)
    return RecordDict({_HEADER: ConfigRecord({"json": header}), _TENSORS: tensors_record(tensors)})


def from_content(content: RecordDict) -> Any:
    """The value `to_content` packed; a content that is not a HetFL message raises CodecError."""
    if _HEADER not in content or _TENSORS not in content:
        raise CodecError(f"not a HetFL message (records: {sorted(content)})")
    header = content[_HEADER]
    tensors = content[_TENSORS]
    if not isinstance(header, ConfigRecord) or not isinstance(tensors, ArrayRecord):
        raise CodecError("a HetFL message needs a ConfigRecord header and an ArrayRecord")
    return decode(str(header["json"]), record_tensors(tensors))


def tensors_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors as an `ArrayRecord` (CPU, NumPy-serialised, exact bits)."""
    return ArrayRecord.from_torch_state_dict({k: v.detach().cpu() for k, v in tensors.items()})


def record_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict())
