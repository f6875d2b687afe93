"""Tests of deploy/: the Helm chart, the image recipe, the NATS permissions, the services as the chart runs them."""
