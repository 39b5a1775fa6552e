"""One job: a Flower SuperNode whose ClientApp stays warm: `hetfl client` runs Flower's own
SuperNode (`flower-supernode --isolation process`) in this process and serves its tasks here
with HetFL's ClientApp, instead of Flower starting a `flwr-clientapp` process per message.

Why: with Flower's default isolation every message costs a process that imports torch and
HetFL and builds the node's partition before it answers (seconds, for a model that trains in
milliseconds). In `process` isolation the SuperNode leaves its ClientApp tasks on its
Runtime API for whatever executor the user runs; this is that executor, in the SuperNode's
own process, so the imports, the node's partition and its client program (`hetfl.deploy.node`'s
cache) are made once and every message after the first costs only its own work. A task is
served as `flwr-clientapp` serves it (Flower's `pull_task_input`, the app, `push_message`,
`push_task_output`), so the node computes exactly what it computed in a process of its own.

Two waits of Flower 1.41's SuperNode loop (`flwr.supernode.start_client_internal`) are
shortened here: its pause when the SuperLink had no message (3 s, `deploy.node_poll_s` here)
and its polls for the ClientApp's reply (0.5 s; here the reply is in the same process). The
executor wakes when the SuperNode has stored a message rather than polling its API.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from logging import ERROR
from types import ModuleType
from typing import Any

from flwr.app import Message
from flwr.app.error import Error
from flwr.clientapp import ClientApp
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # type: ignore[attr-defined]
from flwr.supercore import log
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode import start_client_internal as supernode_loop
from flwr.supernode.cli.flower_supernode import flower_supernode
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

#: The SuperNode loop's pause when the SuperLink had no message (Flower 1.41: 3 s).
FLOWER_IDLE_S = 3.0
#: How often, while a message is in flight, the SuperNode looks for the ClientApp's reply.
REPLY_POLL_S = 0.005
#: The executor also looks for tasks this often when no message woke it (a safety net).
FALLBACK_POLL_S = 10.0


class SuperNodeWaits:
    """Stands in for the `time` module of Flower's SuperNode loop: its idle pause becomes
    `idle_s`, its polls for a reply `REPLY_POLL_S`; everything else is `time`'s."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s

    def sleep(self, seconds: float) -> None:
        time.sleep(self.idle_s if seconds >= FLOWER_IDLE_S else min(seconds, REPLY_POLL_S))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def patch_supernode_loop(loop: ModuleType, idle_s: float, wake: threading.Event) -> None:
    """Shorten `loop`'s waits and set `wake` whenever it has stored a message. Fails, naming
    what is missing, on a Flower whose loop is not 1.41's."""
    missing = [n for n in ("time", "_pull_and_store_message") if not hasattr(loop, n)]
    if missing:
        raise RuntimeError(
            f"{loop.__name__} has no {', '.join(missing)}: this Flower is not the release "
            "HetFL pins (pyproject.toml, flwr==1.41.0); install that one"
        )
    pull = loop._pull_and_store_message

    def pull_and_wake(*args: Any, **kwargs: Any) -> int | None:
        run_id: int | None = pull(*args, **kwargs)
        if run_id is not None:
            wake.set()
        return run_id

    loop.time = SuperNodeWaits(idle_s)  # type: ignore[attr-defined]
    loop._pull_and_store_message = pull_and_wake  # type: ignore[attr-defined]


class WarmExecutor:
    """Serves the SuperNode's ClientApp tasks with `app`, one at a time, in this process.

    `component` is the ClientApp the runs must name (`tool.flwr.app.components.clientapp`
    of their FAB): a run of another app gets an error reply rather than HetFL's answer."""

    def __init__(self, runtime_api: str, app: ClientApp, component: str) -> None:
        self.runtime_api = runtime_api
        self.app = app
        self.component = component
        self.wake = threading.Event()
        self._fab_ok: dict[str, str | None] = {}

    def _client(self, component_name: str, token: str | None = None) -> RuntimeHttpClient:
        interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name=component_name)]
        if token is not None:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        return RuntimeHttpClient.from_server_address(
            server_address=self.runtime_api,
            insecure=True,  # the SuperNode's own Runtime API, on this machine's loopback
            root_certificates=None,
            interceptors=interceptors,
            retry_invoker=make_simple_http_retry_invoker(),
        )

    def serve_forever(self) -> None:
        """Take and serve tasks whenever the SuperNode has stored a message (and every
        `FALLBACK_POLL_S`); a failure to reach the Runtime API (before the SuperNode has
        started it) is logged and tried again."""
        client = self._client("SuperExec")
        request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        while True:
            self.wake.wait(FALLBACK_POLL_S)
            self.wake.clear()
            try:
                while True:
                    acquired = client.AcquireTask(request)
                    if not (acquired.HasField("task") and acquired.token):
                        break
                    self.serve(acquired.token)
            except Exception as exc:  # the SuperNode's API is not up (yet): try again
                log(ERROR, "could not take a ClientApp task from the SuperNode: %s", exc)

    def serve(self, token: str) -> None:
        """One task, as `flwr-clientapp` serves it: pull the message and context, answer
        it with the app (or with an error reply naming the exception), push the reply and
        the context back."""
        client = self._client("flwr-clientapp", token)
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message = reply = context = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            message, context, _run, fab = pull_task_input(client)
            refused = self._refusal(fab.hash_str, fab.content)
            if refused is not None:
                raise RuntimeError(refused)
            reply = self.app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as exc:  # the node goes on; the server is told why (as Flower does)
            log(ERROR, "ClientApp raised an exception", exc_info=exc)
            details = f"{type(exc)}:<'{exc}'>"
            if message is not None:
                error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details)
                reply = Message(error, reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
                push_task_output(client, context, status, details)
            finally:
                heartbeat.stop()
                client.close()

    def _refusal(self, fab_hash: str, content: bytes) -> str | None:
        if fab_hash not in self._fab_ok:
            named = get_fab_config(content)["tool"]["flwr"]["app"]["components"]["clientapp"]
            self._fab_ok[fab_hash] = (
                None
                if named == self.component
                else f"this node serves {self.component} only; the run's ClientApp is {named}"
            )
        return self._fab_ok[fab_hash]


def run_supernode(
    argv: Sequence[str],
    runtime_port: int,
    load_app: Callable[[], ClientApp],
    component: str,
    idle_s: float,
) -> None:
    """Run `flower-supernode ARGV --isolation process` in this process, with its ClientApp
    tasks served warm by `load_app()`'s app in a thread; returns when the SuperNode exits."""
    executor = WarmExecutor(f"127.0.0.1:{runtime_port}", load_app(), component)
    patch_supernode_loop(supernode_loop, idle_s, executor.wake)
    threading.Thread(target=executor.serve_forever, name="hetfl-clientapp", daemon=True).start()
    sys.argv = ["flower-supernode", *argv, "--isolation", "process"]
    flower_supernode()
