"""Claims (leases) and the P2P source registry. `file` is the default backend (shared filesystem); Redis is
optional (`coord/peers_redis.py`, imported only when a redis:// registry is opened)."""

from mxlaunch.coord.base import Claim, ClaimInfo, Coordinator, valid_id
from mxlaunch.coord.file import FileClaim, FileCoordinator
from mxlaunch.coord.peers import (
    LAYOUTS, PeerEntry, PeerRegistry, Publication, SourceRecord, local_record, open_registry)
from mxlaunch.coord.peers_file import FileRegistry

__all__ = ["Claim", "ClaimInfo", "Coordinator", "FileClaim", "FileCoordinator", "FileRegistry", "LAYOUTS",
           "PeerEntry", "PeerRegistry", "Publication", "SourceRecord", "local_record", "open_registry", "valid_id"]
