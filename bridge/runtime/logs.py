"""structlog set up once per process; every line says which component and replica wrote it."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(fmt: str = "json", level: str = "info", *, component: str = "", replica: str = "") -> None:
    """JSON lines on stderr (``fmt="console"`` for people). ``component`` (``mapper``,
    ``pairing``, ``gate``, ``exporter``, ``relay``, ...) and ``replica`` (the pod or host name,
    pairing's replica name) go into every line, also those written by other threads (the Kafka
    client's, the profiler's), which structlog's context variables would not reach."""
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    origin = {k: v for k, v in (("component", component), ("replica", replica)) if v}

    def add_origin(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        for key, value in origin.items():
            event.setdefault(key, value)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_origin,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
