"""Claims (leases) and the P2P source registry. `file` is the default backend (shared filesystem); Redis is
optional (`coord/peers_redis.py`, imported only when a redis:// registry is opened). Claims: coord/base.py
(the protocol), coord/file.py, coord/s3.py; the registry: coord/peers.py (records, `open_registry`) and its
backends. Callers import the module that defines the name; this file re-exports nothing."""
