"""Plot one per-client trace field over rounds for a few clients of a run.

`clients.jsonl` holds a row per round and client asked, with the fields the method declares
under "fields" (DTFL's `tier`) beside the row's own (`loss`, `steps`, ...); this draws one
numeric field against the round
for the chosen clients, one step line each (offset a little, so that clients on the same
value stay visible), so a scheduler's choices can be seen moving as the clients' device
profiles switch.

Usage: python tools/plot_trace.py RUN_DIR FIELD [--clients 0,3,7] [-o tiers.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hetfl.engine.outputs import read_metrics


def series(rows: list[dict], field: str, clients: list[int]) -> dict[int, tuple[list, list]]:
    """Per client, the rounds it was asked and its `field` in each, from the trace rows."""
    found: dict[int, tuple[list, list]] = {c: ([], []) for c in clients}
    for row in rows:
        value = (row.get("fields") or {}).get(field, row.get(field))
        if row["cid"] in found and isinstance(value, int | float):
            found[row["cid"]][0].append(row["round"])
            found[row["cid"]][1].append(value)
    missing = [c for c, (rounds, _) in found.items() if not rounds]
    if missing:
        raise SystemExit(f"no {field!r} in the trace for client(s) {missing}")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run directory holding clients.jsonl")
    parser.add_argument("field", help="a numeric trace field, e.g. tier")
    parser.add_argument("--clients", default="0,1,2", help="client ids, comma-separated")
    parser.add_argument("-o", "--out", type=Path, default=Path("trace.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(args.run / "clients.jsonl")
    clients = [int(c) for c in args.clients.split(",")]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    found = series(rows, args.field, clients)
    for i, (cid, (rounds, values)) in enumerate(found.items()):
        # a small vertical offset per client, so that clients on the same value stay visible
        offset = (i - (len(found) - 1) / 2) * 0.05
        ax.step(rounds, [v + offset for v in values], where="mid", label=f"client {cid}")
    ax.set_xlabel("round")
    ax.set_ylabel(args.field)
    ax.set_title(f"{args.run.name}: {args.field} per round")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
