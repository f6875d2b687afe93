"""What every long-running service shares, behind this one public module: the services' one
doorway to the rest of the bridge (they import this module, the pure core and their own
package, nothing else of the bridge: two contracts in pyproject.toml check it).

* `Service` (lifecycle): the one shape of the five services (name, settings, health, metrics
  registry, stopper, connection, grace, `start` -> loops, `stop`, what its start and stop log
  lines carry); `run_service(service)`: a service command's process (logging, the event loop,
  uvloop for the mapper and pairing, the exit code: 2 for a setting that cannot work).
* `serve(service)` (lifecycle): a service's whole life, the same for every one: SIGTERM/SIGINT, the
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
* The doorway to what lies below: the settings (bridge/config.py: `Settings`, `SettingError`,
  `role_values`, `load_price_table`) and NATS (bridge/nats/: the modules `streams`,
  `subjects`, `follow`, and the names the services use of the others), re-exported as they
  are, so a service names only this module.
"""

from bridge.runtime.activity import ActivityMetrics
from bridge.runtime.health import Health
from bridge.runtime.labels import OTHER, BoundedLabel, observe_many
from bridge.runtime.lifecycle import Linger, Loop, Service, Stopper, close_connection, metrics_port, run_service, serve
from bridge.runtime.logs import configure_logging
from bridge.runtime.profiling import rss_kb

# ---- the doorway: settings and NATS, re-exported for the services
from bridge.config import Settings, SettingError, load_price_table, role_values
from bridge.nats import follow, streams, subjects
from bridge.nats.bootstrap import configured_replicas, ensure_stream
from bridge.nats.connection import UNANSWERED, connect_service, ordered_subscribe, outage, server_list, until_answered
from bridge.nats.lanes import FACT_TIMEOUT_S, KvLanes, PinnedLane, epoch_of, lane_fact_key, lost_create
from bridge.nats.lookup import (DEFAULT_MARGIN_NS, SCAN_BUDGET, SERVER_MARGIN_NS, duplicate_window_s, find_msg_id,
                                msg_ids_on, stored_ns)
from bridge.nats.publish import AckPublisher, wait_all
from bridge.nats.wire import ack_many
from bridge.nats.wire import publish_many as publish_now
from bridge.nats.pull import Puller

__all__ = ["OTHER", "ActivityMetrics", "BoundedLabel", "Health", "Linger", "Loop", "Service", "Stopper", "close_connection",
           "configure_logging", "observe_many", "metrics_port", "rss_kb", "run_service", "serve",
           # the doorway
           "Settings", "SettingError", "load_price_table", "role_values",
           "follow", "streams", "subjects", "configured_replicas", "ensure_stream",
           "UNANSWERED", "connect_service", "ordered_subscribe", "outage", "server_list", "until_answered",
           "FACT_TIMEOUT_S", "KvLanes", "PinnedLane", "epoch_of", "lane_fact_key", "lost_create",
           "DEFAULT_MARGIN_NS", "SCAN_BUDGET", "SERVER_MARGIN_NS", "duplicate_window_s", "find_msg_id", "msg_ids_on", "stored_ns",
           "AckPublisher", "Puller", "ack_many", "publish_now", "wait_all"]
