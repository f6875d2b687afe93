"""A service's life, the same for every one: the `Service` shape the five services share, and
`serve` (signals, the HTTP port, the allocation profiler, start and the cleanup after a failed
one, its loops, its NATS connection watched, the stop: loops given a grace, then cancelled,
the connection closed, the exit code); `run_service`, a service command's process around it."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import time
from typing import Any, Awaitable, Callable, Coroutine, Iterable, Mapping

import structlog
from prometheus_client import CollectorRegistry

from bridge.config import ROLE_METRICS_PORT, Settings, SettingError
from bridge.nats.connection import CONNECT_WAITING
from bridge.runtime.health import Health, HttpServer
from bridge.runtime.logs import configure_logging
from bridge.runtime.profiling import start_allocation_profiler, stop_allocation_profiler

#: what a service runs until it stops: coroutines that return once `Stopper.stopping`
Loop = Coroutine[Any, Any, None]


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (a dependency where it builds), else None (asyncio's):
    what the mapper and pairing run on (issue 24: docs/BENCHMARKS.md "Cost")."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


#: The cyclic collector's first threshold for the hot-path services (``fast_loop``): Python's
#: 700 runs a young collection every ~700 net allocations, ~2,000 times a minute in the mapper at
#: 2,000 events/s: 4.9 % of the mapper's CPU and 2.6 % of pairing's went to the collector
#: (gc.callbacks, cost.py at 2,000/s, 2026-12-07). At 50,000 it ran twice in the minute, and the
#: mapper + pairing spent 0.200 ms per event against 0.210 the run before (RSS 60 / 79 MiB
#: against 64 / 85). Nearly all of their garbage is freed by reference counts; the older
#: generations keep their defaults (10, 10), so a cycle is still collected within minutes. What
#: it costs: a young collection walks up to 50,000 objects and an older one more, on the event
#: loop (a 10-minute soak at 2,000/s: p99 146 ms against 162 with 700, so no worse there); and
#: cycles made faster than usual (exceptions' tracebacks in an error storm, holding their frames'
#: payloads) wait longer for a collection.
GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> tuple[int, int, int]:
    """The collector's thresholds for a hot-path service (`GC_YOUNG_THRESHOLD`); returns them."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    return gc.get_threshold()


class Stopper:
    """SIGTERM / SIGINT -> an asyncio.Event the service's loop watches."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.signal: str | None = None

    def install(self) -> "Stopper":
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.trigger, sig.name)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        return self

    def trigger(self, why: str = "requested") -> None:
        self.signal = why
        self.event.set()

    #: why the service must stop and exit non-zero (None: a requested stop, exit 0)
    failed: str | None = None

    def fail(self, why: str) -> None:
        if not self.event.is_set():
            self.failed = why
        self.trigger(why)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    @property
    def stopping(self) -> bool:
        return self.event.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True when stopping. (asyncio.timeout: wait_for would run
        the wait in a task of its own, on every pass of every service's timed loops.)"""
        try:
            async with asyncio.timeout(seconds):
                await self.event.wait()
        except TimeoutError:
            return False
        return True


class Linger:
    """The pause after each batch of one loop (the mapper's).

    A batch of less than a quarter of the fetch size and of fewer than ``target`` messages is
    followed by a pause of ``base_s``
    (AEP_BRIDGE_LINGER_MS), longer when the loop's stream is quiet: long enough for about
    ``target`` messages at the rate the loop has seen (over its recent batches: messages and
    seconds since the batch before, each decayed by ``DECAY`` per batch), at most ``max_s``
    (AEP_BRIDGE_LINGER_MAX_MS). A batch costs its
    wake-ups, socket writes and acks whatever its size, so a quiet fleet handled one message
    per batch costs several times more per event than a busy one (issue 24); what arrives
    meanwhile waits at most ``max_s``, a catch-up (a full batch) never. A pause ends on a
    multiple of ``base_s`` on the monotonic clock (`after`).
    """

    #: the weight a batch's messages and seconds keep per later batch (~4 batches' memory)
    DECAY = 0.75

    def __init__(self, base_s: float, max_s: float | None = None, target: int = 32) -> None:
        self.base_s = base_s
        self.max_s = max(base_s, max_s if max_s is not None else base_s)
        self.target = target
        self._last = time.monotonic()
        # Messages and seconds of the recent batches, each decayed by DECAY per batch: the rate a
        # pause is sized by. One batch's own rate is noise (lanes come in bursts): at 2,000/s a
        # partition's batch of one after a 40 ms gap sized a pause of the maximum.
        self._n = 0.0
        self._t = 0.0

    def seconds(self, n: int, small: bool, now: float | None = None) -> float:
        """How long to pause after a batch of ``n`` (``small``: under a quarter of the fetch size)."""
        now = time.monotonic() if now is None else now
        elapsed, self._last = now - self._last, now
        target = self.target
        # A batch that already holds the target needs no pause: the pause is there to gather
        # about that many. Before, any batch under a quarter of the fetch size paused, so the
        # mapper (40-60 messages a batch) and every pairing partition paused at 2,000 events/s
        # too: soak.py p50 125 ms against 30 ms without a pause, for 16 % less CPU (2026-12-04).
        if n > 0:
            # A batch's seconds count up to 4x what alone gives the maximum pause: a gap of an
            # hour is no more evidence of a quiet stream than that, and is not carried for
            # dozens of batches once the stream is busy again. (4x, not 1x: at 1x it would also
            # cut ordinary gaps of a stream near the maximum. cost.py, alternated, could not
            # tell 4x, no cap and the code before apart: flatness 1.36-1.55, 2026-12-04.)
            elapsed = min(elapsed, 4 * self.max_s * n / target)
            self._n, self._t = self.DECAY * self._n + n, self.DECAY * self._t + elapsed
        if not small or self.base_s <= 0 or n >= target:
            return 0.0
        if self.max_s <= self.base_s or n <= 0:
            return self.base_s
        return min(self.max_s, max(self.base_s, target * self._t / self._n))

    async def after(self, n: int, small: bool) -> float:
        """Pause (`seconds`) and return how long the pause was meant to be (0.0: none).

        The pause ends on the next multiple of ``base_s`` on the monotonic clock after
        ``seconds``."""
        seconds = self.seconds(n, small)  # (the pause counts as the next batch's gathering time)
        if seconds > 0:
            now = time.monotonic()
            await asyncio.sleep(seconds + (-(now + seconds)) % self.base_s)
        return seconds


async def watch_connection(nc: Any, stopper: Stopper, health: Health, log: Any, every_s: float = 0.5) -> None:
    """Stop the service (exit 1) when its connection is unusable for good: closed (nats-py
    does not reconnect a connection the server closed with an error), or its credentials
    refused while reconnecting. A server that is merely away is retried by nats-py forever
    (`/readyz` is false meanwhile, `/healthz` says `reconnecting`)."""
    health.connection = nc
    while not stopper.stopping:
        why = None
        last = getattr(nc, "last_error", None)
        if nc.is_closed:
            why = f"NATS connection closed ({type(last).__name__}: {last})" if last else "NATS connection closed"
        elif nc.is_reconnecting and last is not None and "authoriz" in f"{type(last).__name__} {last}".lower():
            why = f"NATS refused the credentials while reconnecting ({type(last).__name__}: {last})"
        if why is not None:
            if not stopper.stopping:
                log.error("nats_connection_lost", error=why, action="exit 1: a supervisor starts the service again")
                health.failed = why
                stopper.fail(why)
            return
        if await stopper.sleep(every_s):
            return


async def close_connection(nc: Any) -> None:
    """Flush what is in flight (acks included), then close. Not `drain()`: with a pull
    subscription bound it can wait for its full timeout."""
    if nc is not None and not nc.is_closed:
        try:
            await nc.flush(timeout=3)
        except Exception:
            pass
        await nc.close()


def metrics_port(settings: Settings, default_port: int, port: int | None = None) -> int:
    """The HTTP port: ``port`` (a caller's, e.g. 0 in tests), else ``AEP_BRIDGE_METRICS_PORT``
    (``--metrics-port``), else the service's default."""
    if port is not None:
        return port
    return default_port if settings.metrics_port is None else settings.metrics_port


class Service:
    """The one shape of the five services (mapper, pairing, gate, relay, exporter): what `serve`
    runs. A service sets ``settings``, ``health``, ``stopper`` and ``registry`` (its /metrics)
    when it is made, ``nc`` (its connection) when it connects, and its class says:

    * ``name``: its role (the logger, the log lines ``<name>_starting`` / ``_stopping``, the
      metrics port's default: `default_port`);
    * ``grace_s``: how long its loops get to finish what they hold once it is asked to stop;
    * ``fast_loop``: run on uvloop when installed (the mapper and pairing: issue 24), with the
      cyclic collector's young threshold raised (`tune_gc`, issue 43).

    It implements `start` (connect, bind: its loops) and, when it has any, `stop` (its own
    cleanup, on a connection still open), `starting` / `stopping` (what those log lines carry),
    `connection` (when it is not ``nc``). Nothing else of its life is its own: signals, the
    HTTP port, the profiler, the connection watched and closed, the exit code are `serve`'s."""

    name: str = "service"
    grace_s: float = 10.0
    fast_loop: bool = False
    settings: Settings
    health: Health
    stopper: Stopper
    registry: CollectorRegistry | None = None
    nc: Any = None
    #: the name its log lines carry as ``replica`` ("": the instance, AEP_BRIDGE_INSTANCE)
    replica: str = ""

    @property
    def default_port(self) -> int | None:
        """The port of its /metrics, /healthz and /readyz unless AEP_BRIDGE_METRICS_PORT says
        another (bridge/config.py ROLE_METRICS_PORT); None: it serves no such port of the
        runtime's (the relay answers them on its own, beside the AEP bindings)."""
        return ROLE_METRICS_PORT.get(self.name)

    async def start(self) -> list[Loop]:
        """Connect and bind; the loops to run until the stopper is set."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Its own cleanup after the loops ended, before the connection is closed."""

    def starting(self) -> Mapping[str, Any]:
        return {}

    def stopping(self) -> Mapping[str, Any]:
        return {}

    def connection(self) -> Any:
        """Its NATS connection, whatever it is by now (None before it connected)."""
        return self.nc

    async def close(self) -> None:
        """Flush and close its connection: for a caller that drives its steps by hand (tests,
        benchmarks); `serve` does it after every run."""
        await close_connection(self.connection())


async def serve(service: Service, *, port: int | None = None) -> int:
    """Run one service; its exit code: 0 after a requested stop (SIGTERM, SIGINT,
    `stopper.trigger`), 1 after a failure (`stopper.fail`: the NATS connection closed for good
    or its credentials refused, a loop that raised or ended on its own). A failed start raises.

    In order: signals go to its stopper; the HTTP port (`/metrics` of its registry, `/healthz`,
    `/readyz` of its health) listens when it has a `default_port` (``port`` when given, e.g. 0
    in tests; see `metrics_port`); the allocation profiler starts (opt-in,
    `AEP_BRIDGE_TRACEMALLOC`); ``<name>_starting`` is logged (with ``metrics_port`` and
    `starting`); `start` connects and binds and returns the loops. If it raises:
    ``<name>_start_failed``, the connection (`connection`, whatever it is by then) is closed, the
    port and the profiler stopped, and the exception propagates. Else the loops run, and the
    connection is watched, until the stopper is set or a loop ends; then ``<name>_stopping``
    (signal, failed, `stopping`), the loops get ``grace_s`` to finish what they hold and the
    rest are cancelled, `stop` (the service's own cleanup, on an open connection), the
    connection is flushed and closed, the port and the profiler stopped."""
    name, settings, health, stopper = service.name, service.settings, service.health, service.stopper
    log = structlog.get_logger(f"aep_bridge.{name}")
    stopper.install()
    http: HttpServer | None = None
    try:
        default_port = service.default_port
        if default_port is not None:
            bound = metrics_port(settings, default_port, port)
            try:
                http = HttpServer(health, service.registry or CollectorRegistry(), host=settings.metrics_host,
                                  port=bound).start()
            except OSError as exc:  # taken, or not an address here: a setting, exit 2 (no restart loop)
                raise SettingError(f"AEP_BRIDGE_METRICS_PORT (--metrics-port): cannot listen on "
                                   f"{settings.metrics_host}:{bound}: {exc.strerror or exc}") from None
        start_allocation_profiler(name, health)
        log.info(f"{name}_starting", **({"metrics_port": http.port} if http else {}), **service.starting())
        try:
            loops = await _start(service.start, health, stopper, log)
        except BaseException as exc:
            if isinstance(exc, Exception):
                log.error(f"{name}_start_failed", error=f"{type(exc).__name__}: {exc}")
            await close_connection(service.connection())
            raise
        if loops is None:  # stopped while starting (e.g. SIGTERM while NATS does not answer)
            log.info(f"{name}_stopping", signal=stopper.signal, failed=stopper.failed, during="start")
            await close_connection(service.connection())
            return stopper.exit_code
        return await _run(service, loops, log)
    finally:
        if http is not None:
            http.stop()
        stop_allocation_profiler()


def run_service(service: Service, *, port: int | None = None) -> int:
    """A service command's whole run, the same for the five: its log lines (component: its
    name, replica: its `replica`, else the instance), its event loop (uvloop for a
    ``fast_loop`` service, when installed), `serve`, and the exit code: 0 / 1 as `serve`
    says (0 on Ctrl-C), 2 for a setting that cannot work (e.g. its port taken: `aep-bridge up`
    does not restart it), 1 with one line for anything else (the details are in its log)."""
    settings = service.settings
    configure_logging(settings.log_format, settings.log_level, component=service.name,
                      replica=service.replica or settings.instance)
    if service.fast_loop:
        tune_gc()
    try:
        with asyncio.Runner(loop_factory=event_loop_factory() if service.fast_loop else None) as runner:
            return runner.run(serve(service, port=port))
    except KeyboardInterrupt:
        return 0
    except SettingError as exc:
        print(f"aep-bridge: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a clear last line for operators
        print(f"aep-bridge: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


async def _start(start: Callable[[], Awaitable[Iterable[Loop]]], health: Health, stopper: Stopper,
                 log: Any) -> list[Loop] | None:
    """``start()``'s loops, or None when the stopper is set first (start is cancelled: a signal is
    obeyed at once, also while connecting). Each failed attempt to connect is logged
    (``nats_unreachable``) and shown on /healthz (``nats: connecting``, ``nats_error``)."""

    def waiting(error: str, retry_in_s: float) -> None:
        health.nats_error = error
        log.warning("nats_unreachable", error=error, retry_in_s=retry_in_s,
                    action="retrying until the server answers (SIGTERM or Ctrl-C stops)")

    token = CONNECT_WAITING.set(waiting)
    try:  # the task copies the context now: connect_service inside it sees `waiting`
        task = asyncio.ensure_future(start())
    finally:
        CONNECT_WAITING.reset(token)
    stopped = asyncio.ensure_future(stopper.event.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    health.nats_error = None
    if not task.done():
        # Cancelled again until it ends: a cancel can be lost while connecting. Python 3.11's
        # asyncio.wait_for (nats-py's transport connect) answers a cancel that comes as the
        # connection is refused with the refusal (gh-86296, fixed in 3.12), and nats-py's
        # `Client._close` swallows one; the connect loop then retried for ever (CI, 2026-12-07:
        # the exporter still running 15 s after SIGTERM).
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.2)
        if not task.cancelled():
            task.exception()  # retrieved: it ended on its own meanwhile (or failed)
        return None
    return list(task.result())


async def _run(service: Service, loops: list[Loop], log: Any) -> int:
    name, health, stopper, nc = service.name, service.health, service.stopper, service.connection()
    tasks = {asyncio.ensure_future(loop): getattr(loop, "__qualname__", "loop") for loop in loops}
    if nc is not None:
        health.connection = nc
        tasks[asyncio.ensure_future(watch_connection(nc, stopper, health, log))] = "watch_connection"
    stopped = asyncio.ensure_future(stopper.event.wait())
    try:
        running = set(tasks)
        while not stopper.stopping:
            done, running = await asyncio.wait(running | {stopped}, return_when=asyncio.FIRST_COMPLETED)
            running.discard(stopped)
            for task in done - {stopped}:
                if stopper.stopping or task.cancelled():
                    continue
                exc = task.exception()
                why = f"{tasks[task]} failed: {type(exc).__name__}: {exc}" if exc else f"{tasks[task]} ended"
                log.error(f"{name}_loop_failed", error=why, action="exit 1: a supervisor starts the service again")
                health.failed = why
                stopper.fail(why)
    finally:
        log.info(f"{name}_stopping", signal=stopper.signal, failed=stopper.failed, **service.stopping())
        if not stopper.stopping:  # cancelled from outside
            stopper.trigger("stopping")
        stopped.cancel()
        pending = [t for t in tasks if not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=service.grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for task in tasks:  # retrieved, so none is reported as "never retrieved"
            if task.done() and not task.cancelled():
                task.exception()
        try:
            await service.stop()
        except Exception as exc:  # the connection is still closed below
            log.error(f"{name}_stop_failed", error=f"{type(exc).__name__}: {exc}")
        await close_connection(nc)
    return stopper.exit_code
