"""One job: the clients that stop answering under Flower, said on the server's output and
counted, and kept out of sampling so that the server's waits for them are bounded.

A sampled client *misses* a round when no usable reply comes back: none by
`deploy.round_timeout_s`, or Flower's word that the message could not be delivered
(`exchange.TRANSIENT`: the node is offline, its process died, the message's TTL ran out).
Its first miss after answering is said. After `deploy.max_missed_rounds` misses in a row, or
as soon as its node is no longer connected, it is *dropped*: not sampled, so the server
waits for it at most `max_missed_rounds` times `round_timeout_s`. It *rejoins* when its
partition is served by a connected node again that was not the silent one: a node that
registers anew (a restarted `hetfl client`), or its own node connecting again after Flower
had dropped it. Each event is one line on the server's output; `summary.json` counts them
(`unresponsive`), and the checkpoint keeps the state, so a resumed server knows whom it
dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Message

from hetfl.deploy.exchange import TRANSIENT


def missed(reply: Message | None) -> bool:
    """Whether `reply` says the client did not answer (rather than answered badly)."""
    return reply is None or (reply.has_error() and reply.error.code in TRANSIENT)


class Silence:
    """Which clients missed how many rounds in a row, which are dropped, and the counts."""

    def __init__(self, max_missed: int, timeout_s: float, say: Callable[[str], None]) -> None:
        self.max_missed = max_missed
        self.timeout_s = timeout_s
        self.say = say
        self.in_a_row: dict[int, int] = {}
        #: Each dropped client and its node that went silent while connected (None once
        #: that node has left: its reconnecting readmits the client).
        self.dropped: dict[int, int | None] = {}
        self.counts = {"missed": 0, "dropped": 0, "rejoined": 0}

    def after_round(self, rnd: int, replies: Mapping[int, Message | None]) -> None:
        """Record a training exchange: each asked client's reply (None: no reply)."""
        for cid, reply in sorted(replies.items()):
            if not missed(reply):
                self.in_a_row.pop(cid, None)
                continue
            self.in_a_row[cid] = self.in_a_row.get(cid, 0) + 1
            self.counts["missed"] += 1
            if self.in_a_row[cid] == 1:
                self.say(
                    f"warning: client {cid} did not answer in round {rnd} (deploy."
                    f"round_timeout_s = {self.timeout_s:g} s); dropped from sampling after "
                    f"{self.max_missed} round(s) missed in a row (deploy.max_missed_rounds)"
                )

    def available(self, rnd: int, node_of: Mapping[int, int], connected: set[int]) -> set[int]:
        """The registered clients that may be sampled in round `rnd`: drops those that
        missed `max_missed` rounds in a row or whose node left, and readmits those served
        by a connected node again, saying each."""
        for cid, node in sorted(node_of.items()):
            gone = node not in connected
            if cid in self.dropped:
                if gone:
                    self.dropped[cid] = None
                elif node != self.dropped[cid]:
                    self._rejoin(rnd, cid, node)
                continue
            if gone or self.in_a_row.get(cid, 0) >= self.max_missed:
                why = (
                    f"its node {node} is no longer connected"
                    if gone
                    else f"it missed {self.in_a_row[cid]} round(s) in a row"
                )
                self.dropped[cid] = None if gone else node
                self.counts["dropped"] += 1
                self.say(
                    f"warning: client {cid} dropped from sampling from round {rnd}: {why}; "
                    "it rejoins when its node (or a restarted `hetfl client`) connects again"
                )
        return {c for c in node_of if c not in self.dropped}

    def _rejoin(self, rnd: int, cid: int, node: int) -> None:
        del self.dropped[cid]
        self.in_a_row.pop(cid, None)
        self.counts["rejoined"] += 1
        self.say(f"client {cid} rejoined in round {rnd} (node {node})")

    def summary(self) -> dict[str, Any]:
        """`summary.json`'s `unresponsive`: the events counted, and who is dropped now."""
        return {**self.counts, "dropped_now": sorted(self.dropped)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "in_a_row": dict(self.in_a_row),
            "dropped": dict(self.dropped),
            "counts": self.counts,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.in_a_row = dict(state["in_a_row"])
        self.dropped = dict(state["dropped"])
        self.counts = dict(state["counts"])
