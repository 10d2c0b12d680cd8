"""Staging: copying a snapshot's files from shared storage into node-local memory fast and checked. Sources and
their layouts (`sources`, Lustre's `lfs getstripe` in `lustre`), the OST-aware schedule (`schedule`), the
parallel O_DIRECT readers and their per-chunk I/O (`reader`, `worker`, `chunk_io`), room checks (`capacity`,
`hugepages`), manifests and records (`manifest`, `records`) and the way back up (`upload`). Launcher side: no
torch, no engine; `stage.py` at the top runs it as one call (`mxlaunch stage`), `launch/run.py` beside the engine."""
