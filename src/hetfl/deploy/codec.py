"""The wire format of the round protocol, for engines whose clients live in other processes.

Every message of the protocol (`ClientInfo`, `ClientTask`, `EvalTask`, `ClientResult` and
what they hold: specs, index maps with slice or index-tensor selectors and masks, pass
records, local-training records, extras) becomes a pair `(header, tensors)`: `header` is a
JSON text of the plain fields and `tensors` a flat dict of named tensors the header refers
to by key.
The Flower adapter puts the header in a `ConfigRecord` and the tensors in an
`ArrayRecord`; this module itself knows nothing of Flower, so it is tested on its own.

Why not pickle: a message is data from another machine, and unpickling runs code. Here
only the dataclasses listed in `_TYPES` are rebuilt, field by field, and tensors are
plain arrays (Flower serialises them with NumPy, `allow_pickle=False`).

The JSON keeps what JSON alone would lose: tuples stay tuples (specs are hashable,
`input_shape` and `labels` are tuples), slices stay slices, and non-finite floats survive
(a NaN loss must reach the server's result check, not vanish in transit).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from hetfl.core.plateau import PlateauSettings
from hetfl.core.schedule import LrSchedule
from hetfl.core.spec import MapEntry, Spec
from hetfl.core.training import LocalTraining
from hetfl.core.types import ClientInfo, ClientResult, ClientTask, EvalTask, PassRecord

#: The dataclasses a header may rebuild, by name. Nothing else is ever constructed; a
#: field a dataclass does not have is refused, naming it (an unknown training setting).
_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ClientInfo,
        ClientTask,
        EvalTask,
        ClientResult,
        PassRecord,
        MapEntry,
        LocalTraining,
        LrSchedule,
        PlateauSettings,
    )
}

Tensors = dict[str, torch.Tensor]


class CodecError(ValueError):
    """A value that has no wire form, or a header that does not decode."""


def encode(value: Any) -> tuple[str, Tensors]:
    """`value` as (JSON header, tensors by key); `decode` gives back an equal value."""
    tensors: Tensors = {}
    header = json.dumps(_pack(value, tensors), separators=(",", ":"))
    return header, tensors


def decode(header: str, tensors: Tensors) -> Any:
    """The value `encode` was given. Unknown tags, types or tensor keys raise `CodecError`."""
    try:
        plain = json.loads(header)
    except json.JSONDecodeError as exc:
        raise CodecError(f"message header is not valid JSON: {exc}") from None
    return _unpack(plain, tensors)


# A packed value is a JSON scalar, a JSON list (a Python list), or a one-key object whose
# key is the tag: {"tuple": [...]}, {"dict": {...}}, {"tensor": key}, {"slice": [a, b, c]},
# {"spec": {...}}, {"<Dataclass>": {field: ...}}. Untagged objects never occur, so decoding
# is unambiguous.
def _pack(value: Any, tensors: Tensors) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu()
        return {"tensor": key}
    if isinstance(value, Spec):
        return {"spec": {k: _pack(v, tensors) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [_pack(value.start, tensors), _pack(value.stop, tensors), value.step]}
    if isinstance(value, tuple):
        return {"tuple": [_pack(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_pack(v, tensors) for v in value]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise CodecError(f"dict keys must be strings to be sent, got {bad[0]!r}")
        return {"dict": {k: _pack(v, tensors) for k, v in value.items()}}
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and _TYPES.get(name) is type(value):
        return {name: {f.name: _pack(getattr(value, f.name), tensors) for f in _fields(value)}}
    raise CodecError(
        f"cannot send a value of type {type(value).__name__} ({value!r:.80}); allowed: None, "
        f"bool, int, float, str, tuple, list, dict with str keys, tensors, slices, Spec and "
        f"{', '.join(_TYPES)}"
    )


def _fields(value: Any) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(value) if f.init)


def _unpack(plain: Any, tensors: Tensors) -> Any:
    if plain is None or isinstance(plain, bool | int | float | str):
        return plain
    if isinstance(plain, list):
        return [_unpack(v, tensors) for v in plain]
    if not (isinstance(plain, dict) and len(plain) == 1):
        raise CodecError(f"malformed message header near {plain!r:.80}")
    ((tag, body),) = plain.items()
    if tag == "tensor":
        if body not in tensors:
            raise CodecError(f"message header names tensor {body!r}, which was not sent")
        return tensors[body]
    if tag == "spec":
        return Spec({k: _unpack(v, tensors) for k, v in body.items()})
    if tag == "slice":
        start, stop, step = body
        return slice(start, stop, step)
    if tag == "tuple":
        return tuple(_unpack(v, tensors) for v in body)
    if tag == "dict":
        return {k: _unpack(v, tensors) for k, v in body.items()}
    cls = _TYPES.get(tag)
    if cls is None:
        raise CodecError(f"message header has unknown tag {tag!r}")
    try:
        return cls(**{k: _unpack(v, tensors) for k, v in body.items()})
    except TypeError as exc:
        raise CodecError(f"message header does not fit {tag}: {exc}") from None
