"""The Ray the Ray executor runs on: a local Ray started for the run and ended with it,
however the run ends, or a running cluster, joined once its address answers.

- A local Ray (`start_local`): Ray ties its GCS and raylet to the driver (they die with
  it), but not the processes the raylet starts; after a SIGKILL of the driver alone its
  agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) ran on for a minute. So a
  watchdog (`hetfl.engine.watchdog`), started before Ray and told Ray's session folder once
  it is up, kills every process that writes into that folder once the driver is gone, by
  any signal, or closes it.
- A cluster (`join`): Ray's `ray.init` retries an address that does not answer for many
  minutes, printing only its own warnings. The address is tried first with a plain TCP
  connection for up to `ray.connect_timeout_s`; one that never accepts is a user error
  naming it and what to check, and so is Ray giving up on one that accepts but is no Ray
  head (after its own retries).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from hetfl.engine.ports import split_address, wait_for_port
from hetfl.engine.watchdog import Watchdog

#: How long `join` waits, by default, for a cluster's address to accept a connection: a
#: head on a network answers in milliseconds, one still starting within seconds.
CONNECT_TIMEOUT_S = 10.0


def start_local(ray: Any, **init: Any) -> Watchdog:
    """`ray.init(address="local", **init)` under a watchdog of its session folder (`close`
    it after `ray.shutdown()`)."""
    watchdog = Watchdog()
    try:
        started = quiet_init(ray, address="local", **init)
    except BaseException:
        watchdog.close()
        raise
    watchdog.watch(started.address_info["session_dir"])
    return watchdog


def join(ray: Any, address: str, timeout_s: float) -> None:
    """`ray.init(address=address)` ("auto" or host:port) once the address accepts a TCP
    connection within `timeout_s`; a ValueError naming it and what to check otherwise."""
    target = address
    if address == "auto":
        # Ray's own resolution of auto: RAY_ADDRESS, else the cluster `ray start` started
        try:
            target = ray._private.services.canonicalize_bootstrap_address(address)
        except ConnectionError as error:
            raise ValueError(f"ray.address auto: {error}") from None
    named = address if target == address else f"{address} ({target})"
    host, port = split_address(target)
    head = (
        f"that {port} is the port its head was started with (`ray start --head --port`, 6379 "
        "by default; not the dashboard's or Ray Client's)"
    )
    try:
        wait_for_port(host, port, None, timeout_s)
    except TimeoutError:
        raise ValueError(
            f"ray.address {named}: nothing accepted a connection there within {timeout_s:g} s "
            f"(ray.connect_timeout_s); check that the cluster is running (`ray status "
            f"--address {target}` on one of its machines), {head} and that no firewall stands "
            "between, or use ray.address: null for a local Ray"
        ) from None
    try:
        quiet_init(ray, address=address)
    except ConnectionError as error:  # something answers there, not a Ray cluster's head
        raise ValueError(
            f"ray.address {named}: a connection is accepted there but Ray could not join a "
            f"cluster ({error}); check {head} and that the cluster runs Ray {ray.__version__}"
        ) from None


def quiet_init(ray: Any, **options: Any) -> Any:
    """`ray.init` without what would only distract in a run's output: its INFO line
    ("Started a local Ray instance", "Connecting to existing Ray cluster") and its
    FutureWarning on accelerator variables, which does not concern HetFL's units (a CPU
    unit runs on the CPU, whatever CUDA_VISIBLE_DEVICES holds). Warnings and errors of Ray
    still print; a program that calls `ray.init` itself keeps Ray's output as it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Tip: In future versions of Ray", category=FutureWarning
        )
        return ray.init(logging_level=logging.WARNING, **options)
