"""Claims (leases) and, later, the peer registry. `file` is the default backend (shared filesystem)."""

from mxlaunch.coord.base import Claim, ClaimInfo, Coordinator, valid_id
from mxlaunch.coord.file import FileClaim, FileCoordinator

__all__ = ["Claim", "ClaimInfo", "Coordinator", "FileClaim", "FileCoordinator", "valid_id"]
