"""Tests of bridge/services/exporter: the SIEM sinks (Kafka, OTLP), their fencing, replicas and settings."""
