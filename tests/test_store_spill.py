"""The client store under a memory budget: least-recently-used entries spill to disk and
come back bit for bit, checkpoints include them, a resumed run with spilling equals an
uninterrupted one without, and no spill file outlives the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetfl.config import ConfigError, validate
from hetfl.engine.checkpoint import load_checkpoint
from hetfl.engine.entryfile import SpillSegment
from hetfl.engine.heap import _malloc_trim, trim_heap
from hetfl.engine.store import ClientStore, StoreSettings, entry_nbytes
from hetfl.runner import build_simulation


def _odd_entry(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of every kind a store keeps, with values whose bits are easy to lose: NaN
    payloads, -0.0, subnormals, a 0-dim and an empty tensor, a non-contiguous one."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 6, generator=g)
    w[0, 0], w[0, 1], w[0, 2] = float("nan"), -0.0, 1e-45
    nan_payload = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)
    return {
        "w": w,
        "w.t": w.t(),  # non-contiguous: comes back contiguous, same values
        "payload": nan_payload,
        "half": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(3, 2, generator=g).bfloat16(),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "steps": torch.tensor(seed, dtype=torch.long),  # 0-dim
        "mask": torch.rand(9, generator=g) > 0.5,
        "c64": torch.randn(2, generator=g, dtype=torch.complex64),
        "empty": torch.zeros(0, 3),
    }


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())

    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and raw(a[k]) == raw(b[k]) for k in a
    )


def test_spilled_entries_come_back_bit_for_bit(tmp_path):
    store = ClientStore(StoreSettings(memory_budget=0), tmp_path / "spill")
    entries = {cid: _odd_entry(cid) for cid in (5, 1, 9)}
    for cid, entry in entries.items():
        store.put(cid, entry)
    assert store.in_memory() == [] and store.spilled_count() == 3 and store.memory_nbytes() == 0
    assert store.nbytes() == sum(entry_nbytes(e) for e in entries.values())
    assert list(store) == [1, 5, 9] and len(store) == 3 and 9 in store
    for cid, entry in entries.items():
        assert _same_bits(store.get(cid), entry), cid


def test_the_least_recently_used_entry_spills_first(tmp_path):
    one = {"a": torch.zeros(4)}  # 16 bytes
    store = ClientStore(StoreSettings(memory_budget=32), tmp_path / "spill")
    store.put(1, one)
    store.put(2, one)
    store.put(3, one)  # over the budget: 1, the least recently used, spills
    assert store.in_memory() == [2, 3] and store.spilled_count() == 1
    store.get(2)  # 2 is now the most recent: 3 goes next
    store.put(4, one)
    assert store.in_memory() == [2, 4]
    store.get(1)  # read back from disk, and 2 spills for it
    assert store.in_memory() == [4, 1] and store.memory_nbytes() == 32
    assert store.nbytes() == 64 and store.spilled_count() == 2


def test_reading_through_entries_changes_nothing_held(tmp_path):
    store = ClientStore(StoreSettings(memory_budget=16), tmp_path / "spill")
    store.put(1, {"a": torch.ones(4)})
    store.put(2, {"a": torch.full((4,), 2.0)})
    view = store.entries()
    assert torch.equal(view[1]["a"], torch.ones(4))  # spilled: read from disk
    assert store.in_memory() == [2] and list(view) == [1, 2] and len(view) == 2
    with pytest.raises(KeyError):
        view[3]


def test_an_entry_read_back_is_not_written_again_and_a_replaced_one_is_dead(tmp_path):
    store = ClientStore(StoreSettings(memory_budget=16), tmp_path / "spill")
    store.put(1, {"a": torch.ones(4)})
    store.put(2, {"a": torch.ones(4)})  # 1 spills
    size = store.spill_nbytes()
    store.get(1)  # 1 back in memory, 2 spills
    grown = store.spill_nbytes()
    store.get(2)  # 1 evicted again: its record on disk still holds its value
    assert store.spill_nbytes() == grown > size
    store.put(1, {"a": torch.zeros(4)})  # 2 evicted, already on disk; 1's old record dead
    assert store.spill_nbytes() == grown
    store.put(3, {"a": torch.zeros(4)})  # 1's new value spills
    assert torch.equal(store.get(1)["a"], torch.zeros(4))


def test_the_segment_is_compacted_when_dead_records_outweigh_live_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(SpillSegment, "COMPACT_MIN", 0)
    segment = SpillSegment(tmp_path / "s.spill")
    for cid in range(4):
        segment.write(cid, {"a": torch.full((8,), float(cid))})
    full = segment.nbytes()
    record = full // 4  # every record here has the same size
    for value in range(4):  # 4 dead records against 4 live ones: not yet
        segment.write(0, {"a": torch.full((8,), 10.0 + value)})
    assert segment.nbytes() == full + 4 * record
    segment.write(0, {"a": torch.full((8,), 20.0)})  # 5 dead: compacted to the 4 live ones
    assert segment.nbytes() == segment.path.stat().st_size == full
    for cid in range(4):
        expected = 20.0 if cid == 0 else float(cid)
        assert torch.equal(segment.read(cid)["a"], torch.full((8,), expected)), cid
    segment.close()


def test_a_budget_needs_a_spill_directory_and_the_closed_store_says_where_to_look(tmp_path):
    with pytest.raises(ValueError, match="memory_budget needs a spill_dir"):
        ClientStore(StoreSettings(memory_budget=10))
    with pytest.raises(ValueError, match="memory_budget must be >= 0 bytes or None, got -1"):
        StoreSettings(memory_budget=-1)
    store = ClientStore(StoreSettings(memory_budget=0), tmp_path / "spill")
    store.put(1, {"a": torch.ones(1)})
    store.close()
    assert not (tmp_path / "spill").exists()
    with pytest.raises(RuntimeError, match=r"client 1's entry was spilled.*checkpoint"):
        store.get(1)


# -- a run with a budget -------------------------------------------------------------------------
def _config(**store) -> dict:
    """FedBN + FedPer (private BatchNorm and head) over 20 digit clients, local evaluation
    of every client that ever trained (so spilled entries are read back each round)."""
    return {
        "seed": 0,
        "device": "cpu",
        "threads": 1,
        "algorithm": "fedavg",
        "options": {"fedavg": {"private_norm": True, "private_head": True}},
        "data": {"dataset": "digits", "num_clients": 20, "test_per_client": 5},
        "model": {"name": "stage-cnn", "stages": 2, "bn": "batch"},
        "train": {"rounds": 3, "clients_per_round": 6, "local_steps": 2, "batch_size": 16},
        "eval": {"local_eval": "all"},
        "store": store,
    }


def _rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]


class _Interrupted(Exception):
    pass


def test_a_run_that_spills_and_resumes_equals_one_that_never_spilled(tmp_path, monkeypatch):
    whole = build_simulation(validate(_config()), tmp_path / "whole", show_progress=False)
    whole.run()
    entry = max(entry_nbytes(whole.store.get(cid)) for cid in whole.store)
    assert len(whole.store) > 6  # more clients hold state than the budget's 3 entries

    budget = 3 * entry
    cut = build_simulation(
        validate(_config(memory_budget=budget)), tmp_path / "cut", show_progress=False
    )
    aggregate = cut.strategy.aggregate

    def stop_in_round_3(rnd, *args, **kwargs):
        if rnd == 3:
            assert cut.store.spilled_count() > 0 and cut.store.memory_nbytes() <= budget
            assert (tmp_path / "cut" / "spill").is_dir()
            raise _Interrupted
        return aggregate(rnd, *args, **kwargs)

    monkeypatch.setattr(cut.strategy, "aggregate", stop_in_round_3)
    with pytest.raises(_Interrupted):
        cut.run()
    assert not (tmp_path / "cut" / "spill").exists()  # removed on the error too

    resumed = build_simulation(
        validate(_config(memory_budget=f"{budget}B")), tmp_path / "cut", show_progress=False
    )
    resumed.run(resume=True)
    assert not (tmp_path / "cut" / "spill").exists()
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "whole")
    for k, v in whole.state.items():
        assert torch.equal(v, resumed.state[k]), k
    final = load_checkpoint(tmp_path / "cut" / "checkpoints")["store"]  # spilled ones included
    assert list(final) == list(whole.store)
    for cid in whole.store:
        assert _same_bits(final[cid], whole.store.get(cid)), cid
    entries_files = list((tmp_path / "cut" / "checkpoints").glob("*.entries"))
    assert len(entries_files) == 3  # client, server and pending-download stores; none stale


@pytest.mark.parametrize(
    ("given", "bytes_"),
    [(100, 100), (0, 0), ("64MiB", 64 << 20), ("1.5 GiB", 3 << 29), ("12KiB", 12288)],
)
def test_the_memory_budget_is_bytes_or_a_size_with_a_unit(given, bytes_):
    assert validate({"store": {"memory_budget": given}}).store.memory_budget == bytes_
    assert validate({}).store.memory_budget is None


@pytest.mark.parametrize("given", ["64MB", "lots", True, 1.5, "-3MiB"])
def test_a_memory_budget_that_is_not_a_size_is_refused(given):
    with pytest.raises(
        ConfigError, match=r"store\.memory_budget: must be a number of bytes.*'64MiB'"
    ):
        validate({"store": {"memory_budget": given}})


def test_a_negative_memory_budget_is_refused():
    with pytest.raises(ConfigError, match=r"store\.memory_budget: .*greater than or equal to 0"):
        validate({"store": {"memory_budget": -1}})


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fragment_heap(kept: list[bytearray]) -> None:
    """160 MiB allocated and freed, with small blocks among them appended to `kept`."""
    freed = [bytearray(8192) for _ in range(20_000)]
    kept += [bytearray(512) for _ in freed[::16]]
    del freed


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim")
def test_trim_heap_gives_the_freed_space_between_live_blocks_back():
    """Long-lived small blocks among many freed ones (a store entry among a round's
    activations): the freed space stays resident until the heap is trimmed."""
    kept: list[bytearray] = []
    fragment_heap(kept)
    before = _rss_bytes()
    trim_heap()
    assert _rss_bytes() < before - (100 << 20)


_WORKER_HEAP = """
import ctypes, ctypes.util, os
from hetfl.engine.heap import tune_worker_heap, trim_heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block
print(tune_worker_heap(os.environ))
start = rss()
blocks = [touched(1 << 20) for _ in range(200)]  # 200 MiB of 1 MiB blocks: from the heap
for block in reversed(blocks):
    libc.free(block)
kept = rss() - start  # free() trimmed nothing
trim_heap()
trimmed = rss() - start
big = touched(64 << 20)
libc.free(big)  # mapped apart: unmapped by free()
print(kept >> 20, trimmed >> 20, (rss() - start) >> 20)
"""


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim")
def test_a_workers_heap_keeps_blocks_until_trimmed_and_maps_large_ones_apart():
    """`tune_worker_heap`, in a process of its own: the 1 MiB blocks of a training unit stay
    in the heap when freed (with glibc's defaults they are mapped, then unmapped, faulting
    afresh each time) until `trim_heap`; a 64 MiB block (an evaluation batch's
    activations) goes back when freed; what the user set in GLIBC_TUNABLES wins."""
    from hetfl.engine.heap import HEAP_TUNABLES

    def run(tunables: str | None = None) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        env.update({} if tunables is None else {"GLIBC_TUNABLES": tunables})
        done = subprocess.run(
            [sys.executable, "-c", _WORKER_HEAP],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.split()

    for inherited in (None, HEAP_TUNABLES):  # the command line's keeps large blocks in the heap
        tuned, kept, trimmed, after_big = run(inherited)
        assert tuned == "True" and int(kept) >= 190 and int(trimmed) < 20 and int(after_big) < 20
    assert run("glibc.malloc.arena_max=1")[0] == "False"
