"""The artifact store: published per-rank snapshots (`core`: layout, lookup, publish by hard link), captures
on their way in (`capture`), the snapshot manifest (`snapshot`) and least-recently-used pruning (`prune`).
Launcher side: it may use `coord/` for claims and never imports an engine, torch, or the in-engine `plugin/`.
The layout itself is documented in `core`."""
