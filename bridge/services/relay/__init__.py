"""`aep-bridge relay`: the AEP door. AEP-0003 bindings (discovery, SSE, WebSocket) over
AEP_EVENTS, so any AEP consumer (the official SDKs, the reference CLI, dashboards) can watch
the fleet without learning NATS.

Stateless: every replica holds one ordered consumer on AEP_EVENTS (``hub.Hub``) and keeps
nothing but its connections; AEP_EVENTS is the replay buffer (``replay.buffer`` in the
discovery document: a global count, the last N events the stream holds; see
``config.py``). Any number of replicas can run behind one Service.

HTTP stack: aiohttp (server, SSE streaming responses and WebSocket in one well-kept
library). Chosen by ``benchmarks/bench_relay_stack.py`` (SSE fan-out of 3,000 579-byte
events to 100 loopback clients, one writer task per client, 2 shared cores, 2026-12-01):
aiohttp 1,445-1,727 events/s to every client, starlette 1.10 on uvicorn 0.54 1,159-1,276.
"""

from bridge.services.relay.config import RelayConfig, RelayConfigError, from_env
from bridge.services.relay.service import Relay, RelayService

__all__ = ["Relay", "RelayConfig", "RelayConfigError", "RelayService", "from_env"]
