"""The one-machine stack: the embedded nats-server, ``up``, ``demo`` and ``tail``."""
