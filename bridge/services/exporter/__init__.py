"""`aep-bridge exporter`: AEP_EVENTS -> Kafka topics and OTLP/HTTP endpoints, in AEP-0005 forms.

``service`` (the sink workers and the service), ``sinks`` (the transports: Kafka, OTLP/HTTP),
``delivery`` (records in the sinks' framing); the theory of operation is in ``service``.
"""

from bridge.services.exporter.service import Exporter, ExporterMetrics, SinkWorker, load_sinks
from bridge.services.exporter.sinks import ClientMissing, Outcome, require_clients

__all__ = ["ClientMissing", "Exporter", "ExporterMetrics", "Outcome", "SinkWorker", "load_sinks", "require_clients"]
