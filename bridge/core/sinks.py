"""The exporter's sinks as data: where AEP events go, in which AEP-0005 form, which of them.

Two ways to say it, both read into `SinkConfig`:

* a URL (``aep-bridge exporter --sink URL``, ``aep-bridge up --export URL``)::

      kafka://HOST:PORT[,HOST:PORT...]/TOPIC?format=ocsf&max_capture=metadata&mode=binary
      otlp+http://HOST:PORT/v1/logs        (otlp+https:// for TLS)

  Query parameters: ``name``, ``format``, ``max_capture``, ``mode`` (CloudEvents on Kafka:
  ``structured``, the default, or ``binary``), ``filter`` (an attr-match filter as JSON),
  ``batch``, ``replicas``; any other parameter of a Kafka URL with a dot in its name is a librdkafka
  setting passed through (``security.protocol=SASL_SSL&sasl.mechanisms=PLAIN``).
* a document (``AEP_BRIDGE_EXPORT_CONFIG``, YAML or JSON)::

      sinks:
        - name: siem
          url: kafka://kafka-0:9092/aep-ocsf
          format: ocsf
          filter: {type: ["tool.*", "attention.*", "session.*"]}
          kafka: {security.protocol: SASL_SSL, sasl.mechanisms: SCRAM-SHA-512, sasl.username: aep}
        - name: otel
          url: otlp+http://otel-collector:4318/v1/logs
          headers: {authorization: "Bearer ..."}   # or, from the environment:
          headers_from_env: {authorization: OTEL_AUTH_HEADER}

Formats: ``cloudevents`` (Kafka only), ``otlp`` (an OTLP sink always; on Kafka the record is
an OTLP protobuf ExportLogsServiceRequest, what the Collector's Kafka receiver reads) and
``ocsf``. ``max_capture`` is the sink's ceiling (default ``metadata``). ``replicas`` (default 1)
is how many exporter processes share the sink: 1 is one durable ``export-<sink>`` on
AEP_EVENTS; more is `PARTITIONS` lane-hash partitions, each owned by one replica at a time
(bridge/services/exporter/partitions.py). Secrets do not have
to be in the file: ``AEP_BRIDGE_KAFKA_<SETTING>`` (``AEP_BRIDGE_KAFKA_SASL_PASSWORD`` for
``sasl.password``) fills a librdkafka setting of every Kafka sink that does not set it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from bridge.core.attrmatch import MATCH_ALL, Filter, InvalidFilter, compile_filter
from bridge.core.ceiling import LEVELS, METADATA, level_rank

KINDS = ("kafka", "otlp")
FORMATS = ("cloudevents", "otlp", "ocsf")
CE_MODES = ("structured", "binary")
#: the projection (bridge.core.bridges.FORMATS) behind each sink format
PROJECTION = {"cloudevents": "cloudevents", "otlp": "otlp-json", "ocsf": "ocsf"}
KAFKA_ENV_PREFIX = "AEP_BRIDGE_KAFKA_"

#: lane-hash partitions of a sink with replicas > 1 (fixed: a lane's partition must not move);
#: at most this many replicas share a sink
PARTITIONS = 12

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class SinkConfigError(ValueError):
    """A sink that cannot be configured; the message names the sink and the member."""


@dataclass
class SinkConfig:
    name: str
    kind: str  # kafka | otlp
    format: str = "cloudevents"
    max_capture: int = METADATA
    filter: Filter = MATCH_ALL
    # kafka
    bootstrap: str = ""
    topic: str = ""
    ce_mode: str = "structured"
    kafka: dict[str, str] = field(default_factory=dict)  # librdkafka settings passed through
    # otlp
    endpoint: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    batch: int = 256
    replicas: int = 1  # exporter processes sharing the sink: > 1 is the partitioned form

    @property
    def durable(self) -> str:
        """The sink's durable consumer on AEP_EVENTS (replicas 1)."""
        return f"export-{self.name}"

    @property
    def partitioned(self) -> bool:
        return self.replicas > 1

    def partition_durable(self, n: int) -> str:
        """Partition ``n``'s durable consumer on AEP_EXPORT (replicas > 1)."""
        return f"export-{self.name}-p{n}"

    def describe(self) -> dict[str, Any]:
        """For logs and /healthz: everything but the pass-through settings' values (secrets)."""
        where = _without_userinfo(f"{self.bootstrap}/{self.topic}" if self.kind == "kafka" else self.endpoint)
        return {"name": self.name, "kind": self.kind, "format": self.format, "to": where,
                "max_capture": LEVELS[self.max_capture], "filter": self.filter.source,
                **({"replicas": self.replicas} if self.partitioned else {}),
                **({"mode": self.ce_mode, "kafka_settings": sorted(self.kafka)} if self.kind == "kafka" else {})}


def _without_userinfo(where: str) -> str:
    """An endpoint or broker list without ``user:password@`` (logs, /healthz and names show it)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^/@]*@", r"\1", where)


def _default_name(kind: str, where: str) -> str:
    return (kind + "-" + re.sub(r"[^A-Za-z0-9_-]", "_", _without_userinfo(where)))[:64]


def sink_from_mapping(spec: dict[str, Any], environ: dict[str, str] | None = None) -> SinkConfig:
    """One sink of a document (or of a URL's parts); raises SinkConfigError."""
    if not isinstance(spec, dict):
        raise SinkConfigError(f"a sink is a mapping, not {type(spec).__name__}")
    spec = dict(spec)
    url = spec.pop("url", None)
    if url is not None:
        base = _url_parts(str(url))
        base.update({k: v for k, v in spec.items()})
        if isinstance(spec.get("kafka"), dict):
            base["kafka"] = {**base.get("kafka", {}), **spec["kafka"]}
        spec = base
    kind = spec.get("kind")
    if kind not in KINDS:
        raise SinkConfigError(f"sink kind {kind!r}: expected a kafka:// or otlp+http(s):// url")
    where = spec.get("topic") if kind == "kafka" else spec.get("endpoint")
    name = str(spec.get("name") or _default_name(kind, str(where or "")))
    if not _NAME.fullmatch(name):
        raise SinkConfigError(f"sink name {name!r}: 1-64 characters of A-Z a-z 0-9 _ -")
    label = f"sink {name!r}"
    fmt = spec.get("format") or ("otlp" if kind == "otlp" else "cloudevents")
    if fmt not in FORMATS:
        raise SinkConfigError(f"{label}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    if kind == "otlp" and fmt != "otlp":
        raise SinkConfigError(f"{label}: an OTLP sink carries format otlp only, not {fmt!r}")
    try:
        max_capture = level_rank(str(spec.get("max_capture", "metadata")))
    except ValueError as exc:
        raise SinkConfigError(f"{label}: {exc}") from None
    raw_filter = spec.get("filter", {})
    if isinstance(raw_filter, str):
        try:
            raw_filter = json.loads(raw_filter)
        except ValueError as exc:
            raise SinkConfigError(f"{label}: filter is not JSON: {exc}") from None
    try:
        flt = compile_filter(raw_filter)
    except InvalidFilter as exc:
        raise SinkConfigError(f"{label}: invalid filter: {exc}") from None
    try:
        batch = int(spec.get("batch", 256))
    except (TypeError, ValueError):
        raise SinkConfigError(f"{label}: batch must be an integer") from None
    if not 1 <= batch <= 10_000:
        raise SinkConfigError(f"{label}: batch must be within 1..10000")
    try:
        replicas = int(spec.get("replicas", 1))
    except (TypeError, ValueError):
        raise SinkConfigError(f"{label}: replicas must be an integer") from None
    if not 1 <= replicas <= PARTITIONS:
        raise SinkConfigError(f"{label}: replicas must be within 1..{PARTITIONS} (the sink's partitions)")
    out = SinkConfig(name=name, kind=kind, format=fmt, max_capture=max_capture, filter=flt, batch=batch,
                     replicas=replicas)
    if kind == "kafka":
        out.bootstrap, out.topic = str(spec.get("bootstrap") or ""), str(spec.get("topic") or "")
        if not out.bootstrap or not out.topic:
            raise SinkConfigError(f"{label}: a Kafka sink needs brokers and a topic (kafka://HOST:PORT/TOPIC)")
        out.ce_mode = str(spec.get("mode", "structured"))
        if out.ce_mode not in CE_MODES:
            raise SinkConfigError(f"{label}: mode {out.ce_mode!r} is not one of {', '.join(CE_MODES)}")
        settings = spec.get("kafka") or {}
        if not isinstance(settings, dict):
            raise SinkConfigError(f"{label}: kafka settings are a mapping of librdkafka properties")
        out.kafka = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}
        for key, value in (environ or {}).items():
            if key.startswith(KAFKA_ENV_PREFIX) and value:
                prop = key[len(KAFKA_ENV_PREFIX):].lower().replace("_", ".")
                out.kafka.setdefault(prop, value)
    else:
        out.endpoint = str(spec.get("endpoint") or "")
        headers = spec.get("headers") or {}
        if not isinstance(headers, dict):
            raise SinkConfigError(f"{label}: headers are a mapping")
        out.headers = {str(k): str(v) for k, v in headers.items()}
        # headers whose values are in the environment (the chart's headersSecret: a Secret's key)
        from_env = spec.get("headers_from_env") or {}
        if not isinstance(from_env, dict):
            raise SinkConfigError(f"{label}: headers_from_env is a mapping of header: environment variable")
        for header, var in from_env.items():
            value = (environ or {}).get(str(var), "")
            if not value:
                raise SinkConfigError(f"{label}: header {header!r} comes from ${var}, which is not set")
            out.headers[str(header)] = value
    return out


def _url_parts(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if parts.scheme == "kafka":
        topic = unquote(parts.path.lstrip("/"))
        # urlsplit keeps a host list ("a:9092,b:9092") whole in netloc
        out: dict[str, Any] = {"kind": "kafka", "bootstrap": parts.netloc, "topic": topic,
                               "kafka": {k: v for k, v in query.items() if "." in k}}
        out.update({k: v for k, v in query.items() if "." not in k})
        return out
    if parts.scheme in ("otlp+http", "otlp+https", "otlp"):
        scheme = "https" if parts.scheme == "otlp+https" else "http"
        path = parts.path or "/v1/logs"
        out = {"kind": "otlp", "endpoint": f"{scheme}://{parts.netloc}{path}"}
        out.update(query)
        return out
    raise SinkConfigError(f"{url!r}: expected kafka://HOST:PORT/TOPIC or otlp+http(s)://HOST:PORT/v1/logs")


def sink_from_url(url: str, environ: dict[str, str] | None = None) -> SinkConfig:
    return sink_from_mapping({"url": url}, environ)


def sinks_from_document(doc: Any, environ: dict[str, str] | None = None) -> list[SinkConfig]:
    """The sinks of a parsed AEP_BRIDGE_EXPORT_CONFIG document (``{sinks: [...]}``)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("sinks"), list):
        raise SinkConfigError("the export config is a mapping with a list 'sinks'")
    sinks = [sink_from_mapping(s, environ) for s in doc["sinks"]]
    check_unique(sinks)
    return sinks


def check_unique(sinks: list[SinkConfig]) -> None:
    seen: set[str] = set()
    for s in sinks:
        if s.name in seen:
            raise SinkConfigError(f"two sinks are named {s.name!r}: each needs its own durable consumer")
        seen.add(s.name)
