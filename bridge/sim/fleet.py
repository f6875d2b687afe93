"""A fleet of simulated Hermes instances, publishing through the shim's own code path.

What each instance plays (templates from the real corpus, canaries, identities, session
scripts) is `bridge.sim.instances`; this module is how it is published.

How it publishes
----------------
* In-process (the volume): ``bridge.shim.hook.build_record`` stamps and trims each
  envelope exactly as the shim does (same ULID id, ``ts``, subject, body bytes), the
  shim's ``NatsConnection`` publishes it with ``Nats-Msg-Id`` and waits for the
  JetStream ack within ``deadline_ms``, and what is not acked in time goes to the
  instance's spool by the shim's own rule, ``Spool.keep`` (fitted to the default
  max_payload, counted and reported when over the cap or unwritable), and what JetStream
  rejects for good is set aside with ``Spool.reject``. Unlike a real shim, one connection is kept
  open and the records of many instances share one pipelined round trip (a thousand
  processes cannot be spawned 2,000 times a second on two cores). An instance with a
  non-empty spool appends behind it (order), and a drainer thread replays spools with
  ``Spool.replay``, as the next shim invocations or ``aep-bridge spool drain`` would.
* Real shim processes (a configurable fraction of the instances): the byte-compiled
  ``hook.py`` run as ``<python> -I -S hook.pyc`` with the envelope on stdin, as Hermes
  runs it, one process per event, in order per instance. Their envelopes carry a
  marker (``extra.x_aep_sim``) because the shim mints the raw id itself.
* Hostile raw messages (the ``raw_*`` kinds of the hostile mix): stamped by the shim's
  ``build_record`` like any other, then made hostile (``hostile_raw_body``: ``ts`` -1,
  an id that is not a ULID, another instance in the body, ...) and published by the same
  sender as raw bytes on the instance's own subject, bypassing the shim's checks, as a
  compromised or buggy producer with the instance's credential could. The record's
  ``Nats-Msg-Id`` is its manifest id. These, and hostile inputs that are not JSON
  objects (no marker to carry), always take the in-process path.

The manifest
------------
JSON Lines: a ``{"meta": {...}}`` line (settings, the canary strings), one line per
event sent ``{"id", "i" (instance), "h" (hook), "v" ("inproc" | "shim"), "o" (outcome:
published | spooled | dropped | lost | rejected | unknown), "m" (marker, shim only),
"c" (1 when a canary was planted), "e" (a real shim that did not get its whole input in
time: ``stdin_timeout`` or ``truncated``; "id" is then that of the ``_invalid`` message it
published instead, which must be dead-lettered ``shim_invalid``); for the hostile mix also
"x" (its kind) and "r" (the dead-letter reason it is owed, null when it must map), and "v"
"raw" for a raw message published straight to HERMES_RAW}``, and a final ``{"end": {...}}``
line (counts, whether every session was wound down). ``bridge.sim.verify`` reads it.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from bridge.hermes.install import compile_hook
from bridge.shim import hook
from bridge.sim.instances import HOSTILE_MIX, Canaries, Emitted, Ids, Instance, SimOptions, hostile_raw_body

MARKER_KEY = "x_aep_sim"


# ---------------------------------------------------------------- publishing


@lru_cache(maxsize=1)
def compiled_shim() -> Path:
    """hook.py byte-compiled into a private directory: what `aep-bridge hermes install` registers."""
    out = Path(tempfile.mkdtemp(prefix="aep-sim-shim-")) / "hook.pyc"
    return compile_hook(sys.executable, out)


class Manifest:
    """The JSON Lines record of everything sent (thread-safe appends)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "w", encoding="utf-8", buffering=1 << 20)
        self._lock = threading.Lock()

    def write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"
        with self._lock:
            self._f.write(line)

    def close(self) -> None:
        with self._lock:
            self._f.close()


class Sender:
    """The in-process shims: the shim's stamping, wire protocol and spool, one kept connection."""

    def __init__(self, fleet: "Fleet") -> None:
        self.fleet = fleet
        self.cfg = fleet.shim_config
        self.conn: Any = None
        self.spooled: set[str] = set()  # instances whose spool is (or may be) non-empty
        self.lock = threading.Lock()  # guards `spooled` against the drainer
        self.lose_acks = 0  # fault injection: acked records to spool anyway, as if the ack was lost
        self.errors: Counter[str] = Counter()
        #: after a failed connect, no other before this (monotonic): what is sent meanwhile is
        #: spooled, as by a shim that cannot connect, instead of a login attempt per batch (a
        #: refused credential made ~1,500 failed logins a second on the server); at most 1 s apart
        self.retry_at = 0.0
        self.retry_s = 0.0

    def _connection(self, deadline: float) -> Any:
        if self.conn is None and time.monotonic() >= self.retry_at:
            errors: list[str] = []
            self.conn = hook.connect_any(self.cfg, deadline, errors)
            if self.conn is None:
                if errors:
                    self.errors[errors[-1].split(":", 1)[0][:60]] += 1
                self.retry_s = min(1.0, max(0.25, 2 * self.retry_s))
                self.retry_at = time.monotonic() + self.retry_s
            else:
                self.retry_s = 0.0
        return self.conn

    def _drop_connection(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def spool(self, instance: str) -> Any:
        return self.fleet.spool(instance)

    def _append(self, instance: str, records: list[Any], deadline: float) -> list[str]:
        """The shim's fallback (`Spool.keep`): behind the spool, or counted when it cannot be kept."""
        try:
            dropped = self.spool(instance).keep(records, deadline, self.cfg.max_field_bytes)
        except OSError as exc:
            self.errors[f"spool: {type(exc).__name__}"] += 1
            return ["lost"] * len(records)
        # Spool.keep drops the records that do not fit under the cap (the last ones).
        return ["spooled"] * (len(records) - dropped) + ["dropped"] * dropped

    def send(self, items: list[tuple[str, Any]]) -> list[str]:
        """Publish (instance, Record) pairs, pipelined; returns one outcome per item."""
        started = time.monotonic()
        deadline = started + self.cfg.deadline_ms / 1000.0
        outcomes: list[str | None] = [None] * len(items)
        direct: list[int] = []
        behind: dict[str, list[int]] = {}
        with self.lock:
            for i, (instance, _) in enumerate(items):
                if instance in self.spooled:
                    behind.setdefault(instance, []).append(i)
                else:
                    direct.append(i)
        got: list[Any] = []
        if direct:
            conn = self._connection(deadline)
            if conn is not None:
                records = [items[i][1] for i in direct]
                for r in records:
                    hook.fit(r, conn.max_payload, self.cfg.max_field_bytes)
                got = conn.publish(records, deadline)
                if len(got) < len(records):
                    self.errors[str(conn.error or "no ack before the deadline")[:60]] += 1
                    self._drop_connection()
        lost_acks: list[int] = []
        for j, i in enumerate(direct):
            if j < len(got):
                if got[j] is True:
                    outcomes[i] = "published"
                    if self.lose_acks > 0:
                        self.lose_acks -= 1
                        lost_acks.append(i)
                else:  # a permanent rejection, set aside like the shim does
                    outcomes[i] = "rejected"
                    try:
                        self.spool(items[i][0]).reject(items[i][1], got[j])
                    except OSError:
                        pass
            else:
                behind.setdefault(items[i][0], []).append(i)
        for i in lost_acks:  # stored, but the shim never saw the ack: it spools the record too
            behind.setdefault(items[i][0], []).append(i)
        for instance, idx in behind.items():
            idx.sort()
            with self.lock:
                self.spooled.add(instance)
                res = self._append(instance, [items[i][1] for i in idx], deadline)
            for i, o in zip(idx, res):
                if outcomes[i] is None:
                    outcomes[i] = o
        return [o or "unknown" for o in outcomes]

    def close(self) -> None:
        self._drop_connection()


class Drainer(threading.Thread):
    """Replays in-process instances' spools in the background (as their next invocations would)."""

    def __init__(self, fleet: "Fleet") -> None:
        super().__init__(name="sim-drainer", daemon=True)
        self.fleet = fleet
        self.sender = fleet.sender
        self.stop = threading.Event()
        self.hold = threading.Event()  # tests: keep spools as they are (e.g. while a fault is set up)
        self.replayed = 0

    def run(self) -> None:
        cfg = self.sender.cfg
        conn = None
        while not self.stop.is_set():
            with self.sender.lock:
                pending = [] if self.hold.is_set() else list(self.sender.spooled)
            if not pending:
                self.stop.wait(0.1)
                continue
            if conn is None:
                conn = hook.connect_any(cfg, time.monotonic() + cfg.deadline_ms / 1000.0, [])
                if conn is None:
                    self.stop.wait(0.2)
                    continue
            for instance in pending:
                if self.stop.is_set():
                    break
                spool = self.sender.spool(instance)
                try:
                    sent, empty, _busy = spool.replay(conn, time.monotonic() + 1.0)
                except OSError:
                    sent, empty = 0, False
                self.replayed += sent
                if conn.error is not None:
                    conn.close()
                    conn = None
                    break
                if empty:
                    with self.sender.lock:
                        if spool.pending() == 0:
                            self.sender.spooled.discard(instance)
        if conn is not None:
            conn.close()


class ShimWorkers:
    """Real shim processes for the 'shim' instances: one process per event, in order per instance."""

    LOST = re.compile(rb"event (\S+) LOST")
    #: the shim did not get the whole input within its deadline (Hermes wrote stdin late: a
    #: loaded machine schedules the writer after the shim's deadline) or it was over 128 MiB:
    #: what it read is published as `_invalid` under this id, and dead-lettered `shim_invalid`
    CUT = re.compile(rb"event (\S+): (stdin_timeout|truncated): ")

    def __init__(self, fleet: "Fleet", workers: int) -> None:
        self.fleet = fleet
        self.queues: list[queue.Queue[Any]] = [queue.Queue() for _ in range(max(1, workers))]
        self.threads = [threading.Thread(target=self._work, args=(q,), name=f"sim-shim-{i}", daemon=True)
                        for i, q in enumerate(self.queues)]
        self.durations: list[float] = []
        self.failures = 0  # not {} or exit code != 0
        self._lock = threading.Lock()
        self.script = str(compiled_shim())

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def submit(self, slot: int, instance: str, data: bytes, meta: dict[str, Any]) -> None:
        self.queues[slot % len(self.queues)].put((instance, data, meta))

    def pending(self) -> int:
        return sum(q.qsize() for q in self.queues)

    def join(self) -> None:
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()

    def _work(self, q: "queue.Queue[Any]") -> None:
        cmd = [sys.executable, "-I", "-S", self.script]
        while True:
            item = q.get()
            if item is None:
                return
            instance, data, meta = item
            env = self.fleet.shim_env(instance)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, input=data, env=env, capture_output=True, timeout=30)
                out, err, code = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired:
                out, err, code = b"", b"timeout", -1
            elapsed = time.perf_counter() - t0
            outcome = "published"
            cut = self.CUT.search(err)
            if cut:  # the marker was in what the shim never read: the manifest names the id instead
                meta["id"] = cut.group(1).decode("ascii", "replace")
                meta["e"] = cut.group(2).decode("ascii")
            m = self.LOST.search(err)
            if m:
                outcome = "lost"
                meta["id"] = m.group(1).decode("ascii", "replace")
            elif b" dropped " in err or b"is full" in err:
                outcome = "dropped"
            elif b"rejected" in err:
                outcome = "rejected"
            elif b"spooled" in err:
                outcome = "spooled"
            meta["o"] = outcome
            with self._lock:
                self.durations.append(elapsed)
                if code != 0 or out.strip() != b"{}":
                    self.failures += 1
            self.fleet.record(meta, outcome)


@dataclass
class FleetConfig:
    nats_url: str
    instances: int = 100
    rate: float = 200.0  # combined events per second
    duration: float | None = 30.0  # seconds of traffic (then wind down)
    count: int | None = None  # or: stop after this many events
    shim_fraction: float = 0.0  # fraction of instances served by real shim processes
    shim_workers: int = 4
    canary_fraction: float = 0.02
    hostile_fraction: float = 0.0
    hostile_mix: float = 0.0  # fraction of events replaced by the next input of the hostile mix
    big_fraction: float = 0.0005
    seed: int = 1
    deadline_ms: int = 250
    spool_dir: str | None = None
    spool_max_bytes: int = hook.DEFAULT_SPOOL_MAX_BYTES
    wind_down: bool = True  # finish every session after the traffic phase (clean ends for the verifier)
    wind_down_timeout: float = 120.0
    #: events per second while winding down (None: ``rate``). Finishing every session takes
    #: ~3,000 events for 100 instances, 16 s at 200/s: `aep-bridge simulate --duration 5` ran
    #: 22 s; the command winds down faster so that its duration is about the one asked for
    wind_down_rate: float | None = None
    instance_prefix: str = "sim"
    manifest: str | None = None
    batch_ms: float = 5.0
    #: what else the shims connect with (bridge.nats.connection.shim_env: user, password, token,
    #: TLS files; e.g. `aep-bridge up`'s generated credential); the URL is ``nats_url``
    nats_env: dict[str, str] = field(default_factory=dict)


class Fleet:
    """N simulated instances at a combined event rate. ``run()`` blocks; ``stop()`` ends it early."""

    def __init__(self, config: FleetConfig, progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config = c = config
        self.rng = random.Random(c.seed)
        self.ids = Ids(self.rng)
        self.canaries = Canaries.make(random.Random(c.seed * 7919 + 1))
        self.options = SimOptions(canary_fraction=c.canary_fraction, hostile_fraction=c.hostile_fraction,
                                  hostile_mix=c.hostile_mix, big_fraction=c.big_fraction)
        self.spool_dir = c.spool_dir or tempfile.mkdtemp(prefix="aep-sim-spool-")
        self.shim_config = hook.Config({
            **c.nats_env,
            "AEP_BRIDGE_CONFIG": os.devnull,
            "AEP_BRIDGE_NATS_URL": c.nats_url,
            "AEP_BRIDGE_SPOOL_DIR": self.spool_dir,
            "AEP_BRIDGE_DEADLINE_MS": str(c.deadline_ms),
            "AEP_BRIDGE_SPOOL_MAX_BYTES": str(c.spool_max_bytes),
            "AEP_BRIDGE_INSTANCE": "sim",
            "HOME": self.spool_dir,
            # the fallback spool (an unwritable spool dir) stays private to this fleet
            "TMPDIR": self.spool_dir + "/tmp",
        })
        n_shim = round(c.instances * c.shim_fraction) if c.shim_fraction > 0 else 0
        if c.shim_fraction > 0:
            n_shim = max(1, n_shim)
        platforms = ("cli", "cli", "telegram", "discord")
        self.instances: list[Instance] = []
        self.shim_instances: set[str] = set()
        for i in range(c.instances):
            name = f"{c.instance_prefix}-{i:04d}"
            self.instances.append(Instance(name, random.Random(self.rng.getrandbits(64)), self.ids, self.canaries,
                                           self.options, platforms[i % len(platforms)]))
            if i < n_shim:
                self.shim_instances.add(name)
                self.instances[-1].markable = True
        self.manifest_path = Path(c.manifest or Path(self.spool_dir) / "manifest.jsonl")
        self.manifest = Manifest(self.manifest_path)
        self.sender = Sender(self)
        self.drainer = Drainer(self)
        self.shims = ShimWorkers(self, c.shim_workers) if self.shim_instances else None
        self.progress = progress
        self.outcomes: Counter[str] = Counter()
        self.by_via: Counter[str] = Counter()
        self.canaries_planted = 0
        self.hostile: Counter[str] = Counter()  # kind -> inputs of the hostile mix sent
        self.sent = 0
        self.started = 0.0
        self.finished = 0.0
        self.wound: tuple[float, int] | None = None  # (when, events sent) as the wind-down began
        self._stop = threading.Event()
        self._pause = threading.Event()
        self._paused = threading.Event()
        self._counts_lock = threading.Lock()
        self._markers = 0
        self._glued: Instance | None = None  # the instance whose next event is glued to its last one
        self.complete = False

    # ------------------------------------------------------------ control (tests)

    def stop(self) -> None:
        self._stop.set()

    def pause(self, timeout: float = 10.0) -> None:
        """Stop emitting until `resume()`; returns once the emitting loop is parked."""
        self._pause.set()
        self._paused.wait(timeout)

    def resume(self) -> None:
        self._pause.clear()

    def lose_acks(self, n: int) -> None:
        """Fault injection: the next ``n`` records JetStream acks are spooled too, as a shim does
        when the ack does not come back within its deadline (the resend must be absorbed)."""
        self.sender.lose_acks = n

    def spool(self, instance: str) -> Any:
        """The instance's spool as its shim sees it: the spool dir, then the private fallback."""
        return hook.spool_for(self.shim_config, instance)

    def shim_env(self, instance: str) -> dict[str, str]:
        return {
            **self.config.nats_env,
            "TMPDIR": self.spool_dir + "/tmp",
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.spool_dir,
            "AEP_BRIDGE_CONFIG": os.devnull,
            "AEP_BRIDGE_NATS_URL": self.config.nats_url,
            "AEP_BRIDGE_SPOOL_DIR": self.spool_dir,
            "AEP_BRIDGE_INSTANCE": instance,
            "AEP_BRIDGE_DEADLINE_MS": str(self.config.deadline_ms),
            "AEP_BRIDGE_SPOOL_MAX_BYTES": str(self.config.spool_max_bytes),
        }

    # ------------------------------------------------------------ bookkeeping

    def record(self, meta: dict[str, Any], outcome: str) -> None:
        with self._counts_lock:
            self.outcomes[outcome] += 1
        self.manifest.write(meta)

    def _meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "meta": {
                "version": 1,
                "nats_url": c.nats_url.split("@")[-1],
                "instances": c.instances,
                "shim_instances": sorted(self.shim_instances),
                "rate": c.rate,
                "duration": c.duration,
                "count": c.count,
                "seed": c.seed,
                "deadline_ms": c.deadline_ms,
                "spool_dir": self.spool_dir,
                "canaries": self.canaries.strings(),
                "marker_key": MARKER_KEY,
                "hostile_mix": c.hostile_mix,
                "hostile_kinds": HOSTILE_MIX if c.hostile_mix else {},
                "started": time.time(),
            }
        }

    def snapshot(self) -> dict[str, Any]:
        elapsed = (self.finished or time.monotonic()) - self.started if self.started else 0.0
        durations = sorted(self.shims.durations) if self.shims else []
        return {
            "elapsed_s": round(elapsed, 2),
            "sent": self.sent,
            "rate": round(self.sent / elapsed, 1) if elapsed else 0.0,
            "outcomes": dict(self.outcomes),
            "via": dict(self.by_via),
            "canaries_planted": self.canaries_planted,
            "hostile": dict(self.hostile),
            "spooled_instances": len(self.sender.spooled),
            "replayed": self.drainer.replayed,
            "shim_queue": self.shims.pending() if self.shims else 0,
            "shim_runs": len(durations),
            "shim_p50_ms": round(1000 * durations[len(durations) // 2], 1) if durations else None,
            "shim_max_ms": round(1000 * durations[-1], 1) if durations else None,
            "shim_failures": self.shims.failures if self.shims else 0,
            "sender_errors": dict(self.sender.errors.most_common(5)),
            **({"wind_down_s": round((self.finished or time.monotonic()) - self.wound[0], 2),
                "wind_down_events": self.sent - self.wound[1]} if self.wound else {}),
        }

    # ------------------------------------------------------------ the loop

    def _next_event(self, pool: list[Instance]) -> tuple[Instance, Emitted] | None:
        glued, self._glued = self._glued, None
        if glued is not None and glued in pool:  # the rest of a glued pair: right behind it
            ev = glued.next()
            if ev is not None:
                self._glued = glued if ev.glue else None
                return glued, ev
        while pool:
            k = self.rng.randrange(len(pool))
            inst = pool[k]
            ev = inst.next()
            if ev is not None:
                self._glued = inst if ev.glue else None
                return inst, ev
            pool[k] = pool[-1]  # wound down: drop it from the pool
            pool.pop()
        return None

    def run(self) -> dict[str, Any]:
        c = self.config
        self.manifest.write(self._meta())
        if self.shims:
            self.shims.start()
        self.drainer.start()
        pool = list(self.instances)
        self.started = time.monotonic()
        last_report = self.started
        winding = False
        batch_s = c.batch_ms / 1000.0
        try:
            while True:
                now = time.monotonic()
                if self._pause.is_set():
                    self._paused.set()
                    while self._pause.is_set() and not self._stop.is_set():
                        time.sleep(0.01)
                    self.started += time.monotonic() - now  # paused time does not count towards the rate
                    self._paused.clear()
                    continue
                over = self._stop.is_set() or (c.duration is not None and now - self.started >= c.duration) or (
                    c.count is not None and self.sent >= c.count)
                if over and not winding:
                    if not c.wind_down or self._stop.is_set():
                        break
                    winding = True
                    wind_until = now + c.wind_down_timeout
                    self.wound = (now, self.sent)
                    for inst in self.instances:
                        inst.winding_down = True
                if winding and (not pool or now > wind_until or self._stop.is_set()):
                    self.complete = not pool
                    break
                if self.wound is not None and c.wind_down_rate:
                    due = int((now - self.wound[0]) * c.wind_down_rate) - (self.sent - self.wound[1])
                else:
                    due = int((now - self.started) * c.rate) - self.sent
                if due <= 0:
                    time.sleep(min(batch_s, max(0.0005, (self.sent + 1) / c.rate - (now - self.started))))
                    continue
                due = min(due, max(64, int(c.rate * 0.25)))
                items: list[tuple[str, Any]] = []
                metas: list[dict[str, Any]] = []
                taken = 0
                while taken < due or self._glued is not None:  # a glued pair is not split between rounds
                    taken += 1
                    got = self._next_event(pool)
                    if got is None:
                        break
                    inst, ev = got
                    self.sent += 1
                    if ev.canary:
                        self.canaries_planted += 1
                    hostile = {"x": ev.kind, "r": ev.expect} if ev.kind else {}
                    if ev.kind:
                        self.hostile[ev.kind] += 1
                    if inst.name in self.shim_instances and not ev.inproc_only:
                        self._markers += 1
                        marker = f"{inst.name}#{self._markers}"
                        data = _with_marker(ev.data, marker)
                        meta = {"id": None, "i": inst.name, "h": ev.hook, "v": "shim", "m": marker, **hostile}
                        if ev.canary:
                            meta["c"] = 1
                        self.by_via["shim"] += 1
                        assert self.shims is not None
                        self.shims.submit(int(inst.name.rsplit("-", 1)[-1]), inst.name, data, meta)
                        continue
                    cfg = self.shim_config
                    cfg.instance = inst.name
                    record = hook.build_record(ev.data, cfg)
                    if ev.raw:  # raw bytes on the instance's subject, past the shim's checks
                        record = hook.Record(record.id, record.subject, hostile_raw_body(record.message, ev.kind))
                    items.append((inst.name, record))
                    meta = {"id": record.id, "i": inst.name, "h": ev.hook, "v": "raw" if ev.raw else "inproc", **hostile}
                    if ev.canary:
                        meta["c"] = 1
                    metas.append(meta)
                    self.by_via["inproc"] += 1
                if items:
                    for meta, outcome in zip(metas, self.sender.send(items)):
                        meta["o"] = outcome
                        self.record(meta, outcome)
                if self.progress and now - last_report >= 5.0:
                    last_report = now
                    self.progress(self.snapshot())
        finally:
            self.finished = time.monotonic()
            if self.shims:
                self.shims.join()
            self.drainer.stop.set()
            self.drainer.join()
            self.sender.close()
        return self.snapshot()

    def drain(self, timeout: float = 60.0) -> dict[str, Any]:
        """Replay every spool of this fleet's instances (in-process and real shims) until empty,
        as `aep-bridge spool drain` would. Returns what is left (instance -> status)."""
        deadline = time.monotonic() + timeout
        left: dict[str, Any] = {}
        cfg = self.shim_config
        while time.monotonic() < deadline:
            left = {}
            conn = hook.connect_any(cfg, time.monotonic() + 2.0, [])
            if conn is None:
                time.sleep(0.5)
                left = {"*": "NATS not reachable"}
                continue
            try:
                for inst in self.instances:
                    spool = self.spool(inst.name)
                    if spool.pending() == 0:
                        continue
                    try:
                        spool.replay(conn, time.monotonic() + 10.0, wait_lock=True)
                    except OSError as exc:
                        left[inst.name] = str(exc)
                        continue
                    if conn.error is not None:
                        break
                    if spool.pending():
                        left[inst.name] = spool.status()
            finally:
                conn.close()
            if not left:
                self.sender.spooled.clear()
                return {}
            time.sleep(0.2)
        return left

    def edge_losses(self) -> dict[str, int]:
        """Records the shims counted as dropped (spool cap) or lost (spool unwritable), per instance."""
        out = {}
        for inst in self.instances:
            spool = self.spool(inst.name)
            n = spool.dropped()[0] + (spool.fallback.dropped()[0] if spool.fallback is not None else 0)
            if n:
                out[inst.name] = n
        return out

    def close(self) -> None:
        """Write the manifest's end record and close it."""
        self.manifest.write({"end": {**self.snapshot(), "complete": self.complete, "edge_counted": self.edge_losses(),
                                     "ended": time.time()}})
        self.manifest.close()


def _with_marker(data: bytes, marker: str) -> bytes:
    """Add ``extra.x_aep_sim`` to a JSON envelope (hostile bytes are left alone)."""
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if not isinstance(obj, dict) or not isinstance(obj.get("extra"), dict):
        return data
    obj["extra"][MARKER_KEY] = marker
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")
