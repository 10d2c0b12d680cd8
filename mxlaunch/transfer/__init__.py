"""Moving a worker's tensors between processes (P2P): which tensors, which memory, and the NIXL wire.

Torch and nixl are imported only here and in plugin/, inside engine processes (never by the launcher):
    tensor_set.py   what a model holds and its manifest; matching a target against a source's manifest
    regions.py      the allocations to register (one per allocation, not per tensor)
    nixl.py         one NIXL agent per worker: register, publish metadata, one-sided READs from a peer
    nixl_batches.py how a pull's spans are cut into requests (MXLAUNCH_NIXL_PULL), no NIXL import
"""
