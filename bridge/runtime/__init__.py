"""What every long-running service shares, behind this one public module (services import
nothing else of the package; a contract in pyproject.toml checks it).

* `serve` (lifecycle): a service's whole life, the same for every one: SIGTERM/SIGINT, the
  metrics/health port, the allocation profiler, start and the cleanup after a failed start,
  the loops, the NATS connection watched (closed for good, or its credentials refused while
  reconnecting: `/healthz` 503, exit 1, so a supervisor, Kubernetes or `aep-bridge up`,
  starts it again on a new connection instead of leaving a process that consumes nothing and
  looks healthy), the stop (the batch in hand finished, then cancelled after a grace),
  `close_connection`, the exit code. `Stopper` is what the loops watch and sleep on; `Linger`
  is the mapper's pause after a small batch (longer when the stream is quiet).
* `Health`, the HTTP port (health): `/metrics` (Prometheus text), `/healthz` (the loop beats,
  its NATS connection is not closed for good and nothing failed; `nats` says the connection's
  state), `/readyz` (connected and consuming), served by the standard library's WSGI server in
  a daemon thread, so a busy event loop cannot make a liveness probe time out.
* `configure_logging` (logs): structlog, JSON lines on stderr (`AEP_BRIDGE_LOG_FORMAT=console`
  for people), every line with its `component` and `replica`.
* `BoundedLabel` (labels): metric labels from the wire, bounded; `observe_many`: a batch's
  values into a histogram at once.
* `ActivityMetrics` (activity): what the fleet does and spends (model calls, tokens, cost,
  tools, approvals, runs), counted from the events pairing publishes.
* Allocation profiling (profiling, opt-in, `AEP_BRIDGE_TRACEMALLOC=<dir>`), started and
  stopped by `serve`; `rss_kb`.
"""

from bridge.runtime.activity import ActivityMetrics
from bridge.runtime.health import Health
from bridge.runtime.labels import OTHER, BoundedLabel, observe_many
from bridge.runtime.lifecycle import Linger, Loop, Stopper, close_connection, metrics_port, serve
from bridge.runtime.logs import configure_logging
from bridge.runtime.profiling import rss_kb

__all__ = ["OTHER", "ActivityMetrics", "BoundedLabel", "Health", "Linger", "Loop", "Stopper", "close_connection", "configure_logging", "observe_many",
           "metrics_port", "rss_kb", "serve"]
