"""Shim instances whose first server is a cut node (issue 42: "shim instances whose first server
is the cut node land through the majority"; the shim's side of "A server that cannot serve
JetStream", docs/ARCHITECTURE.md).

`CutFirstShims` runs a few simulated Hermes instances (the simulator's own `Instance` scripts, so
their sessions are whole and the verifier checks them like the fleet's) through the real shim
delivery (`hook.deliver`: a run's deadline, each server's share of it, the spool, its replay),
each run with the cut node first in its server list:

* ``during(victim, seconds)``: in a thread, each instance sends its next event every
  `EVERY_S` while the cut lasts. Every run starts at the cut node: the list is ``victim`` then
  the others, the instance names are chosen so that the shim's own rotation (a hash of the
  name) keeps that order, and its memory of the last server that acked
  (``<spool>/<instance>.server``) is removed before each run. The cut node takes the publish and
  never acks it (no quorum), so an ack can only come from the next server: the majority.
* ``finish()``: every instance winds down (its sessions ended, the list in its configured order),
  then its spool is replayed until empty (what `aep-bridge spool drain` does).
* ``acked_during`` / ``runs_during``: per instance and cut, the runs acked (``published``) while
  the cut lasted, and all its runs then.

Each event goes into the fleet's manifest (``Fleet.record``) like an in-process one, so the
scenario's verification (no loss, no duplicate, invariants) covers them, and `landed` reads the
instances' raw ids back from HERMES_RAW, per instance.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from typing import Any

from bridge.shim import hook
from bridge.sim.instances import Ids, Instance

EVERY_S = 0.5  # one event per instance this often while a cut lasts
PREFIX = "cutfirst"


def first_kept(name: str, n: int) -> bool:
    """Does the shim's rotation (`hook.server_order`) keep a list of ``n`` servers in its order
    for an instance named ``name``?"""
    h = 0
    for b in name.encode("utf-8", "replace"):
        h = (h * 31 + b) & 0xFFFFFFFF
    return h % n == 0


def names(count: int, n: int) -> list[str]:
    out: list[str] = []
    k = 0
    while len(out) < count:
        name = f"{PREFIX}-{k:04d}"
        if first_kept(name, n):
            out.append(name)
        k += 1
    return out


class CutFirstShims:
    def __init__(self, fleet: Any, urls: list[str], count: int = 2, seed: int = 42) -> None:
        self.fleet = fleet
        self.urls = list(urls)
        rng = random.Random(seed)
        ids = Ids(random.Random(rng.getrandbits(64)))
        self.instances = [Instance(name, random.Random(rng.getrandbits(64)), ids, fleet.canaries, fleet.options, "cli")
                          for name in names(count, len(urls))]
        self.sent: dict[str, list[str]] = {i.name: [] for i in self.instances}  # raw ids, in order
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (instance, outcome)
        self.acked_during: dict[tuple[str, str], int] = {}  # (instance, cut) -> runs acked while it lasted
        self.runs_during: dict[tuple[str, str], int] = {}
        self.thread: threading.Thread | None = None
        self.errors: list[str] = []

    def config(self, name: str, first: str | None) -> Any:
        order = [first] + [u for u in self.urls if u != first] if first else self.urls
        return hook.Config({
            **self.fleet.config.nats_env,
            "AEP_BRIDGE_CONFIG": os.devnull,
            "AEP_BRIDGE_NATS_URL": ",".join(order),
            "AEP_BRIDGE_SPOOL_DIR": self.fleet.spool_dir,
            "AEP_BRIDGE_INSTANCE": name,
            "HOME": self.fleet.spool_dir,
            "TMPDIR": self.fleet.spool_dir + "/tmp",
        })

    def send(self, inst: Instance, cfg: Any, forget: bool) -> str | None:
        ev = inst.next()
        if ev is None:
            return None
        if forget:  # this run starts at the cut node, not at the server that acked last
            try:
                os.unlink(hook._server_memo_path(cfg))
            except OSError:
                pass
        started = time.monotonic()
        record = hook.build_record(ev.data, cfg)
        outcome = hook.deliver(record, cfg, started)
        self.sent[inst.name].append(record.id)
        self.outcomes[(inst.name, outcome)] += 1
        meta = {"id": record.id, "i": inst.name, "h": ev.hook, "v": "inproc", "o": outcome}
        if ev.canary:
            meta["c"] = 1
            self.fleet.canaries_planted += 1
        self.fleet.record(meta, outcome)
        return outcome

    def during(self, victim: str, seconds: float, label: str) -> None:
        """Send while ``victim`` (a URL of the list) is cut, for ``seconds`` from now, in a thread
        (``label``: the cut's name in `acked_during`)."""
        self.join()
        until = time.monotonic() + seconds

        def work() -> None:
            cfgs = {i.name: self.config(i.name, victim) for i in self.instances}
            try:
                while time.monotonic() < until:
                    t = time.monotonic()
                    for inst in self.instances:
                        outcome = self.send(inst, cfgs[inst.name], forget=True)
                        if outcome is not None and time.monotonic() < until:
                            key = (inst.name, label)
                            self.runs_during[key] = self.runs_during.get(key, 0) + 1
                            self.acked_during[key] = self.acked_during.get(key, 0) + (outcome == "published")
                    time.sleep(max(0.0, t + EVERY_S - time.monotonic()))
            except Exception as exc:  # reported by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")

        self.thread = threading.Thread(target=work, name="cutfirst", daemon=True)
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=60)
            assert not self.thread.is_alive(), "the cut-first shims did not stop"
            self.thread = None

    def finish(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wind every instance down (its list in its configured order), then replay its spool
        until empty; returns what is left (instance -> spool status)."""
        self.join()
        for inst in self.instances:
            inst.winding_down = True
            cfg = self.config(inst.name, None)
            while self.send(inst, cfg, forget=False) is not None:
                pass
        deadline = time.monotonic() + timeout
        left: dict[str, Any] = {}
        while time.monotonic() < deadline:
            left = {}
            for inst in self.instances:
                cfg = self.config(inst.name, None)
                spool = hook.spool_for(cfg, inst.name)
                if spool.pending() == 0:
                    continue
                conn = hook.connect_any(cfg, time.monotonic() + 2.0, [])
                if conn is None:
                    left[inst.name] = "NATS not reachable"
                    continue
                try:
                    spool.replay(conn, time.monotonic() + 10.0, wait_lock=True)
                finally:
                    conn.close()
                if spool.pending():
                    left[inst.name] = spool.status()
            if not left:
                return {}
            time.sleep(0.2)
        return left

    def landed(self, pipe: Any) -> dict[str, int]:
        """Per instance, how many of its raw ids are not in HERMES_RAW."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        async def read(js: Any) -> set[str]:
            subjects = [f"hermes.raw.{name}.>" for name in self.sent]
            sub = await js.pull_subscribe(subjects[0], stream="HERMES_RAW", config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0,
                filter_subject=None, filter_subjects=subjects))
            out: set[str] = set()
            while True:
                try:
                    msgs = await sub.fetch(256, timeout=2)
                except Exception:
                    break
                out.update((m.headers or {}).get("Nats-Msg-Id", "") for m in msgs)
            await sub.unsubscribe()
            return out

        stored = pipe.run(read, timeout=60)
        return {name: sum(1 for rid in ids if rid not in stored) for name, ids in self.sent.items()}
