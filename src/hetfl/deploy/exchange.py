"""One job: the messages of one exchange with Flower nodes: push them all, pull the replies
until each is answered or the time is up, and decode a reply or say why it is unusable."""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from hetfl.core.types import FailureKind
from hetfl.deploy import profile
from hetfl.deploy.codec import CodecError
from hetfl.deploy.records import from_content

K = TypeVar("K", bound=Hashable)

#: Flower error codes that say nothing about the node's answer (a message expired or could
#: not be delivered, the node is offline or its process died): worth asking again.
TRANSIENT = frozenset(
    {
        ErrorCode.UNKNOWN,
        ErrorCode.MESSAGE_UNAVAILABLE,
        ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
        ErrorCode.NODE_UNAVAILABLE,
        ErrorCode.CLIENT_APP_CRASHED,
    }
)


#: The first wait between pulls for replies; each next one doubles, up to `poll_s`, so a
#: reply that comes in milliseconds is seen in milliseconds and a long round costs few pulls.
FIRST_POLL_S = 0.01
#: The longest wait between pulls for replies (the server's `poll_s`): a reply waits for the
#: next pull, on average half of this once the waits have doubled up to it; a pull is one
#: small request to the SuperLink. 0.5 s cost about 0.25 s per exchange in the README
#: example (benchmarks/README.md, "Deployment rounds over Flower").
POLL_S = 0.1


class Exchange:
    """Exchanges with the nodes of `grid`, pulling replies after waits that double from
    `FIRST_POLL_S` up to `poll_s` seconds."""

    def __init__(self, grid: Grid, poll_s: float) -> None:
        self.grid = grid
        self.poll_s = poll_s

    def connected(self) -> set[int]:
        """The ids of the nodes connected now."""
        return set(self.grid.get_node_ids())

    def __call__(self, messages: Mapping[K, Message], timeout: float) -> dict[K, Message]:
        """Push all messages, then pull replies until each is answered or `timeout` passes.

        Replies are matched to requests by message id (an error reply for an unreachable
        node comes from the SuperLink, not from the node).
        """
        if not messages:
            return {}
        keys = list(messages)
        ids = list(self.grid.push_messages([messages[k] for k in keys]))
        pending = {mid: k for k, mid in zip(keys, ids, strict=False) if mid}
        replies: dict[K, Message] = {}
        deadline = time.monotonic() + timeout
        timing = profile.enabled()
        wait = FIRST_POLL_S
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                key = pending.pop(reply.metadata.reply_to_message_id, None)
                if key is not None:
                    replies[key] = reply
                    if timing:
                        profile.record(
                            side="server",
                            message=reply.metadata.reply_to_message_id,
                            seen=time.time(),
                        )
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(min(wait, self.poll_s))
            wait *= 2
        return replies


def answer_of(
    reply: Message | None, keys: tuple[str, ...], missing: str = "no reply in time"
) -> tuple[dict[str, Any], str | None]:
    """The decoded reply, or why there is none usable (`missing` when none came)."""
    if reply is None:
        return {}, missing
    if reply.has_error():
        return {}, f"client error: {(reply.error.reason or '').strip()}"
    try:
        answer = from_content(reply.content)
    except CodecError as exc:
        return {}, f"malformed reply: {exc}"
    if not isinstance(answer, dict) or any(k not in answer for k in keys):
        return {}, f"malformed reply: expected fields {list(keys)}"
    return answer, None


def failure_kind(reply: Message | None) -> FailureKind:
    """The kind of a reply `answer_of` found unusable: none came, an error came, or what
    came did not decode."""
    if reply is None:
        return "timeout"
    return "client-error" if reply.has_error() else "invalid"
