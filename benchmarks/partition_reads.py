"""How a KV bucket's reads fare while its leader is cut off from its peers (issue 42; root,
nftables: tests/support/partition.py).

A three-node cluster bootstrapped at R3; the leader of ``KV_aep_lane_facts`` is cut from both
peers for ``--seconds``; meanwhile a client pinned to each node reads one key, every ~0.1 s, with
a direct get (``$JS.API.DIRECT.GET``, what nats-py's KV ``get`` sends when the stream allows
direct) and with the leader's message get (``$JS.API.STREAM.MSG.GET``), 0.4 s timeout each. One
line per node and kind: ``.`` answered, ``e`` an error answer, ``x`` no answer; then the lost
counts, and those after the first leader's answer from the healthy side.

    sudo .venv/bin/python benchmarks/partition_reads.py [--seconds 14]

2026-12-07, nats-server 2.15.1 (docs/BENCHMARKS.md "Network partitions"): from the two healthy
nodes, direct gets were lost at random for the whole cut, 11 of 46 and 20 of 50 (two runs)
after the new leader answered; the leader's message gets were answered every time from then
on; the cut node answered direct gets from its own copy throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import partition as P  # noqa: E402

BUCKET_STREAM = "KV_aep_lane_facts"
KEY_SUBJECT = "$KV.aep_lane_facts.zz.partition-reads"


async def run(cluster, cut, leader: str, seconds: float) -> dict[tuple[str, str], str]:
    import nats

    names = [n.name for n in cluster.nodes]
    url = {n.name: n.url for n in cluster.nodes}
    ncs = {n: await nats.connect(servers=[url[n]], allow_reconnect=False) for n in names}
    await ncs[leader].request(KEY_SUBJECT, b"v", timeout=5)
    body = json.dumps({"last_by_subj": KEY_SUBJECT}).encode()
    kinds = {"direct": f"$JS.API.DIRECT.GET.{BUCKET_STREAM}", "leader": f"$JS.API.STREAM.MSG.GET.{BUCKET_STREAM}"}

    async def one(node: str, kind: str) -> str:
        try:
            reply = await ncs[node].request(kinds[kind], body, timeout=0.4)
        except Exception:
            return "x"
        status = (reply.headers or {}).get("Status")
        return "e" if status or b'"error"' in (reply.data or b"")[:100] else "."

    rows = {(n, k): "" for n in names for k in kinds}
    t0 = time.monotonic()
    cut.isolate(leader)
    try:
        while time.monotonic() - t0 < seconds:
            keys = list(rows)
            for key, r in zip(keys, await asyncio.gather(*(one(n, k) for n, k in keys))):
                rows[key] += r
            await asyncio.sleep(0.1)
    finally:
        cut.heal()
        for nc in ncs.values():
            await nc.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=14.0)
    args = ap.parse_args()
    why = P.unavailable()
    if why:
        sys.exit(f"cannot partition here: {why}")
    with P.partitioned_cluster() as (cluster, cut):
        cluster.bootstrap(3)
        leader = cluster.wait_leader(BUCKET_STREAM)
        rows = asyncio.run(run(cluster, cut, leader, args.seconds))
    healthy = [n.name for n in cluster.nodes if n.name != leader]
    # the first round in which a healthy node's leader get was answered: the new leader
    answered = [rows[(n, "leader")].find(".") for n in healthy]
    first = min(a for a in answered if a >= 0) if any(a >= 0 for a in answered) else None
    for (node, kind), line in rows.items():
        role = "cut leader" if node == leader else "healthy"
        after = f"; after the new leader: {line[first:].count('x')} of {len(line) - first} lost" \
            if first is not None and node != leader else ""
        print(f"{node} ({role}) {kind:6s} {line}  lost {line.count('x')} of {len(line)}{after}")


if __name__ == "__main__":
    main()
