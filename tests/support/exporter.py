"""AEP events straight into AEP_EVENTS, as pairing publishes them, and Kafka topic counts:
for exporter tests and benchmarks/bench_exporter.py."""

from __future__ import annotations

from typing import Any, Iterable

from bridge.core.aep import encode_event
from bridge.nats.subjects import events_subject, token
from tests.support.services import expected_events, publish_all, raw_records


def aep_messages(envelopes: Iterable[dict[str, Any]], n: int | None = None, instance: str = "bench") -> list[tuple[str, bytes, str]]:
    """(subject aep.hermes.<lane>.<type>, body, event id) of the events the mapping makes of
    ``envelopes`` (the first ``n`` when given)."""
    raws = raw_records(envelopes, instance=instance)
    events = expected_events([(i + 1, body) for i, (_, body, _) in enumerate(raws)], epoch=0)
    out = []
    for e in events[:n] if n is not None else events:
        lane = e.session if isinstance(e.session, str) else "_"
        out.append((events_subject(token(lane), e.type), encode_event(e), e.id))
    return out


def sim_messages(n: int, seed: int = 1) -> list[tuple[str, bytes, str]]:
    """``n`` AEP events of bridge/sim's realistic sessions."""
    from bridge.sim.sessions import realistic_envelopes

    return aep_messages(realistic_envelopes(int(n * 1.1) + 100, seed=seed), n, instance=f"sim{seed}")


#: AEP events (subject, body, id) into AEP_EVENTS, as raw records are published: Nats-Msg-Id = the id
load = publish_all


class TopicCounter:
    """Counts the topic's messages as they arrive (a consumer from the start, in a thread).
    Not the high watermarks: Tansu's fall short of the messages it serves (the last batch's)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        import threading
        import time

        self.bootstrap, self.topic = bootstrap, topic
        self.count = 0
        self.first_at: float | None = None
        self._time = time.perf_counter
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from tests.support.tansu import from_the_start

        c = from_the_start(self.bootstrap, self.topic)
        try:
            while not self._stop.is_set():
                for m in c.consume(1000, timeout=0.2):
                    if not m.error():
                        if self.first_at is None:
                            self.first_at = self._time()
                        self.count += 1
        finally:
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
