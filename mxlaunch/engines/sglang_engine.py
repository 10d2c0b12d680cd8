"""SGLang as the launcher sees it: the `Engine` object (engines/protocol.py) and where SGLang puts workers.

Placement follows `sglang.srt.entrypoints.engine._calculate_rank_ranges` (and the data-parallel
controller's `launch_tensor_parallel_group`, the same arithmetic per DP replica). SGLang keeps its stock
--load-format (its enum rejects new names): the command for every strategy is the command as given,
and the plugin's hook on the loader factory decides what loads, per the plan file.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mxlaunch.engines import quantization, sglang_argv, sglang_quantization
from mxlaunch.engines.base import LaunchSpec
from mxlaunch.engines.environment import model_config
from mxlaunch.engines.sglang import SGLangLog

SNAPSHOT_FORMATS = ("sharded_state", "presharded")  # SGLang's stock dump formats, besides raw
_MULTINODE = ("nnodes", "node_rank", "dist_init_addr")


class SGLangEngine:
    name = sglang_argv.ENGINE
    display = "SGLang"
    version_dists = ("sglang",)  # the distributions its version is read from
    plugin_group = "sglang.srt.plugins"
    plugin_allowlist = "SGLANG_PLUGINS"
    log_format = SGLangLog
    snapshot_formats = SNAPSHOT_FORMATS
    shm_prefixes = ("sglang_loads_",)  # 0.5.23 leaves one sglang_loads_* per run
    # ZeroMQ ipc:// sockets named by tempfile.NamedTemporaryFile (server_args.PortArgs): the temp folder's tmpXXXXXXXX
    ipc_socket_names = r"tmp[a-z0-9_]{8}"
    ipc_dir_var = None
    # JIT caches (../shared/ENGINES.md), set before sglang is imported
    kernel_cache_vars = (("SGLANG_CACHE_DIR", "sglang"), ("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                         ("FLASHINFER_WORKSPACE_BASE", "flashinfer"), ("SGLANG_DG_CACHE_DIR", "deep_gemm"),
                         ("TILELANG_CACHE_DIR", "tilelang"), ("CUDA_CACHE_PATH", "cuda"), ("TVM_FFI_CACHE_DIR", "tvm_ffi"))
    # 0.5.2x: `import sglang` points these into $SGLANG_CACHE_DIR when unset (srt/environ.py third_party_cache_defaults,
    # FlashInfer's base the root itself; SGLANG_DG_CACHE_DIR defaults to its deep_gemm folder); checked against
    # SGLang itself by tests/e2e/test_sglang_cache_places_oracle.py
    kernel_cache_redirect = ("SGLANG_CACHE_DIR", ".cache/sglang",
                             (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("CUDA_CACHE_PATH", "nv"),
                              ("TILELANG_CACHE_DIR", "tilelang"), ("FLASHINFER_WORKSPACE_BASE", ""),
                              ("SGLANG_DG_CACHE_DIR", "deep_gemm")))
    command_forms = f"`python -m {sglang_argv.SERVER_MODULE} --model-path MODEL ...` or `sglang serve MODEL ...`"
    zygote_preload = ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                      "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager")
    snapshot_sleep_flags = ()  # its release_memory_occupation is not wired in (yet)
    snapshot_refill_extension = None

    def matches(self, argv: Sequence[str]) -> bool:
        return sglang_argv.is_sglang_command(list(argv))

    def parse(self, argv: Sequence[str], *, engine_version: Optional[str] = None) -> LaunchSpec:
        return sglang_argv.parse_sglang_argv(list(argv), engine_version=engine_version)

    def explicit_fields(self, argv: Sequence[str]) -> Dict[str, Any]:
        return sglang_argv.explicit_fields(list(argv))

    def local_ranks(self, spec: LaunchSpec) -> List[Dict[str, int]]:
        return local_ranks(spec)

    def command(self, spec: LaunchSpec, strategy: str) -> List[str]:
        return list(spec.argv)

    def multinode_flags(self, argv: Sequence[str], nnodes: int, node_rank: int, addr: str, port: int) -> List[str]:
        """--nnodes N --node-rank R --dist-init-addr HEAD:PORT, each unless the command sets it (any alias,
        argparse abbreviation or its --config file); nothing when the command says one node."""
        given = {k: v for k, v in self.explicit_fields(argv).items() if k in _MULTINODE}
        if int(given.get("nnodes", nnodes)) <= 1:
            return []
        add: List[str] = []
        if "nnodes" not in given:
            add += ["--nnodes", str(nnodes)]
        if "node_rank" not in given:
            add += ["--node-rank", str(node_rank)]
        if "dist_init_addr" not in given:
            add += ["--dist-init-addr", f"{addr}:{port}"]
        return add

    def serves_http(self, spec: LaunchSpec) -> bool:
        return not (spec.headless or (spec.nnodes > 1 and spec.node_rank > 0))  # node rank > 0: workers only

    def device_type(self, spec: LaunchSpec) -> Optional[str]:
        return None

    def kernel_cache_flags(self, argv: Sequence[str]) -> Dict[str, Any]:
        return sglang_argv.compile_flags(list(argv))

    def kernel_cache_env(self, environ: Mapping[str, str]) -> Dict[str, str]:
        return {}  # SGLang's caches are keyed by their own content hashes, not by its environment

    def start_env(self, spec: LaunchSpec, device_type: str, environ: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
        return {}, "SGLang sets its own start method (spawn) for its scheduler and detokenizer"

    def snapshot_format_refusal(self, spec: LaunchSpec, option: str) -> Optional[str]:
        return snapshot_format_refusal(spec, option)

    def quantization_refusal(self, spec: LaunchSpec) -> Optional[str]:
        return sglang_quantization.quantization_refusal(spec)

    def quantization_summary(self, spec: LaunchSpec) -> Optional[Dict[str, str]]:
        return quantization.summary(spec, sglang_quantization.quantization_refusal(spec), None,
                                    sglang_quantization.RAW_NOTE)


ENGINE = SGLangEngine()


# ---- placement ----------------------------------------------------------------------------------------


def rank_ranges(tp: int, pp: int, nnodes: int, node_rank: int) -> Tuple[range, range]:
    """(pp ranks, tp ranks) SGLang starts on `node_rank` — `_calculate_rank_ranges` in
    sglang/srt/entrypoints/engine.py (0.5.23), the same arithmetic per DP replica."""
    pp_per_node = max(pp // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp, 1)
    pp_ranks = range(pp_per_node * (node_rank // nnodes_per_pp_rank), pp_per_node * (node_rank // nnodes_per_pp_rank + 1))
    tp_per_node = tp // nnodes_per_pp_rank
    tp_ranks = range(tp_per_node * (node_rank % nnodes_per_pp_rank), tp_per_node * (node_rank % nnodes_per_pp_rank + 1))
    return pp_ranks, tp_ranks


def local_ranks(spec: LaunchSpec) -> List[Dict[str, int]]:
    """The workers SGLang starts on this node. Every DP replica (separate worlds, each spanning all
    nodes) gets the same (pp, tp) ranges; a worker's key is dp_rank·(TP·PP) + pp_rank·TP + tp_rank and
    its snapshot rank pp_rank·TP + tp_rank (SGLang's world rank, `spawn_world_rank`)."""
    pp_ranks, tp_ranks = rank_ranges(spec.tp, spec.pp, spec.nnodes, spec.node_rank)
    world = spec.tp * spec.pp
    out = []
    for dp_rank in range(spec.dp):
        for pp_rank in pp_ranks:
            for tp_rank in tp_ranks:
                r = pp_rank * spec.tp + tp_rank
                out.append({"rank": dp_rank * world + r, "dp_rank": dp_rank, "pp_rank": pp_rank,
                            "tp_rank": tp_rank, "snapshot_rank": r})
    return out


# ---- stock snapshot formats ---------------------------------------------------------------------------


def snapshot_format_refusal(spec: LaunchSpec, snapshot_format: str) -> Optional[str]:
    """Why a stock SGLang snapshot format (`sharded_state`, `presharded`) cannot hold this model, or None.

    Those formats save the weights *after* SGLang's post-processing; servekit found they silently drop or
    mangle weights for these cases, so mxlaunch refuses them up front (raw is always allowed)."""
    if snapshot_format == "raw":
        return None
    choices = ("raw", *SNAPSHOT_FORMATS)
    if snapshot_format not in choices:
        return f"--snapshot-format {snapshot_format} is not one of {', '.join(choices)}"
    quant = (spec.quantization or "").lower()
    cfg = model_config(spec.model_path)
    arch = " ".join(cfg.get("architectures") or [])
    qcfg = cfg.get("quantization_config") or {}
    quant_method = (quant or str(qcfg.get("quant_method", ""))).lower()
    backend = str(spec.layout_extras.get("moe_runner_backend", "auto"))
    if quant_method == "mxfp4" and backend in ("triton", "triton_kernel", "auto"):
        return f"{snapshot_format}: mxfp4 with the Triton MoE backend stores swizzled weights it cannot reload"
    if quant_method == "gguf" or spec.load_format == "gguf":
        return f"{snapshot_format}: GGUF weights are dequantized/repacked on load and cannot be saved back"
    if quant_method in ("nvfp4", "modelopt_fp4") and "Deepseek" in arch:
        return f"{snapshot_format}: NVFP4 DeepSeek weights are reshuffled after loading and do not round-trip"
    if quant_method in ("gptq", "gptq_marlin") and qcfg.get("desc_act"):
        return f"{snapshot_format}: act-order GPTQ is permuted for Marlin after loading and does not round-trip"
    if cfg.get("kv_lora_rank") is not None:
        return f"{snapshot_format}: MLA models ({arch or 'kv_lora_rank set'}) lose kv_b_proj, which SGLang splits after loading"
    return None

