"""One job: which Flower nodes serve which clients. Before round 1 and at the start of every
round, nodes not yet known are asked who they are (their partition, `ClientInfo` and data
settings); a node is admitted, or refused for good when its answer rules it out (its data
settings differ from the server's, its partition is out of range or served by another
connected node). The available clients are the registered ones whose node is connected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Message

from hetfl.core.types import ClientInfo
from hetfl.deploy.exchange import TRANSIENT, Exchange, answer_of
from hetfl.deploy.records import REGISTER, to_content


class Membership:
    """The registered clients of a run, by partition id, and the nodes serving them."""

    def __init__(
        self,
        exchange: Exchange,
        config_text: str,
        fingerprint: Mapping[str, Any],
        expected: int,
        say: Callable[[str], None],
    ) -> None:
        """`config_text` goes to each node asked; `fingerprint` is the data settings a node
        must match; `expected` the number of partitions; `say` prints a message."""
        self.exchange = exchange
        self.config_text = config_text
        self.fingerprint = dict(fingerprint)
        self.expected = expected
        self.say = say
        self.infos: dict[int, ClientInfo] = {}
        self.node_of: dict[int, int] = {}
        self.refused: set[int] = set()

    def wait_for(self, need: int, timeout_s: float, poll_s: float) -> None:
        """Register nodes until `need` clients are known, or fail after `timeout_s` naming
        the partitions still missing."""
        deadline = time.monotonic() + timeout_s
        self.say(f"waiting for {need} of {self.expected} clients to register")
        while len(self.infos) < need:
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.expected)) - set(self.infos))
                raise TimeoutError(
                    f"only {len(self.infos)} of the {need} clients needed registered within "
                    f"deploy.registration_timeout_s = {timeout_s:g} s; missing partitions: "
                    f"{missing}. Start them with `hetfl client --partition-id I --config "
                    "CONFIG`, or lower deploy.min_clients"
                )
            unknown = self.unknown_nodes()
            if unknown:
                self.register(unknown, timeout=deadline - time.monotonic())
            else:
                time.sleep(poll_s)
        self.say(f"{len(self.infos)} clients registered: {sorted(self.infos)}")

    def unknown_nodes(self) -> list[int]:
        known = set(self.node_of.values()) | self.refused
        return sorted(n for n in self.exchange.connected() if n not in known)

    def register(self, node_ids: Iterable[int], timeout: float) -> None:
        """Ask nodes who they are; admit them, or refuse them for good when their answer
        (or their ClientApp failing) rules them out. A node that did not answer, or whose
        message Flower could not deliver in time, is asked again later."""
        request = to_content({"config": self.config_text})
        messages = {
            nid: Message(request, nid, REGISTER, ttl=timeout, group_id="register")
            for nid in node_ids
        }
        replies = self.exchange(messages, timeout)
        connected = self.exchange.connected()
        for nid in sorted(replies):
            reply = replies[nid]
            answer, problem = answer_of(reply, ("partition_id", "info", "data"))
            if problem is not None and reply.has_error() and reply.error.code in TRANSIENT:
                self.say(f"warning: node {nid} not registered yet: {problem}")
                continue
            if problem is None:
                problem = self._admit(nid, answer, connected)
            if problem is not None:
                self.refused.add(nid)
                self.say(f"warning: node {nid} refused: {problem}")

    def _admit(self, nid: int, answer: Mapping[str, Any], connected: set[int]) -> str | None:
        cid, info = answer["partition_id"], answer["info"]
        if not isinstance(info, ClientInfo) or info.cid != cid:
            return f"malformed registration (partition {cid!r}, info {info!r:.80})"
        if answer["data"] != self.fingerprint:
            diff = {
                k: (answer["data"].get(k), v)
                for k, v in self.fingerprint.items()
                if answer["data"].get(k) != v
            }
            return (
                f"its data settings differ from the server's, so partition {cid} would not be "
                f"the same data; (node, server): {diff}"
            )
        if not 0 <= cid < self.expected:
            return f"partition {cid} is outside 0..{self.expected - 1}"
        holder = self.node_of.get(cid)
        if holder is not None and holder != nid and holder in connected:
            return f"partition {cid} is already served by node {holder}"
        if holder is not None and info != self.infos[cid]:
            return f"it serves partition {cid} with other data than its previous node"
        self.node_of[cid] = nid
        self.infos[cid] = info
        return None

    def known(self) -> list[ClientInfo]:
        return [self.infos[c] for c in sorted(self.infos)]

    def available(self, timeout: float) -> list[ClientInfo]:
        """The registered clients whose node is connected, after registering new nodes."""
        self.register(self.unknown_nodes(), timeout=timeout)
        connected = self.exchange.connected()
        return [self.infos[c] for c in sorted(self.infos) if self.node_of[c] in connected]

    def connected_clients(self, cids: Iterable[int]) -> list[int]:
        """Those of `cids` whose node is connected now, in id order."""
        connected = self.exchange.connected()
        return [c for c in sorted(cids) if self.node_of[c] in connected]
