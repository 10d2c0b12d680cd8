"""What of a vLLM launch changes the code vLLM compiles — the flags (COMPILE_FLAGS, as the command sets them)
and the VLLM_* environment its own compile cache hashes — the engine's part of the kernel cache key
(kernelcache/caches.py). Apart from the argv parser (engines/vllm_argv.py), which it reads through, because
it follows vLLM's compile cache, not its command line: the two change for different reasons."""

from __future__ import annotations

import hashlib
import re
from typing import Any, Dict, List, Mapping

from mxlaunch.engines import argmirror as A
from mxlaunch.engines import vllm_argv

# Flags that change what vLLM compiles (graphs, kernels): the kernel cache key digests them (mxlaunch/kernelcache/caches.py).
COMPILE_FLAGS = ("--compilation-config", "--optimization-level", "--max-num-batched-tokens", "--max-num-seqs",
                 "--max-model-len", "--enforce-eager", "--dtype", "--quantization", "--kv-cache-dtype", "--block-size",
                 "--tensor-parallel-size", "--pipeline-parallel-size", "--enable-expert-parallel", "--attention-backend",
                 "--model-impl", "--hf-overrides", "--cuda-graph-sizes", "--enable-chunked-prefill", "--async-scheduling")


# vLLM's own compile cache also hashes its environment: every VLLM_* variable it knows except these
# (vllm/envs.py `compile_factors`: the union of 0.26.0's and 0.32.0's lists; tests/unit/test_kernelcache.py
# checks it against the installed vLLM). The kernel cache key takes the same variables, so an archive restored
# for one environment is never one vLLM would ignore and recompile anyway.
COMPILE_ENV_IGNORED = frozenset((
    "VLLM_RPC_BASE_PATH", "VLLM_USE_MODELSCOPE", "VLLM_RINGBUFFER_WARNING_INTERVAL", "VLLM_DEBUG_DUMP_PATH",
    "VLLM_PORT", "VLLM_CACHE_ROOT", "VLLM_ENABLE_STARTUP_PLAN", "VLLM_SERVER_DEV_MODE", "VLLM_DP_MASTER_IP",
    "VLLM_DP_MASTER_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_RANDOMIZE_DP_DUMMY_INPUTS",
    "VLLM_MODEL_REDIRECT_PATH", "VLLM_HOST_IP", "VLLM_FORCE_AOT_LOAD", "VLLM_USAGE_STATS_SERVER",
    "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_STREAM",
    "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_COLOR", "VLLM_LOG_STATS_INTERVAL", "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
    "VLLM_TUNED_CONFIG_FOLDER", "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "VLLM_FLASHINFER_AUTOTUNE_SKIP_OPS",
    "VLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_IMAGE_FETCH_TIMEOUT",
    "VLLM_VIDEO_FETCH_TIMEOUT", "VLLM_AUDIO_FETCH_TIMEOUT", "VLLM_MEDIA_CACHE", "VLLM_MEDIA_CACHE_MAX_SIZE_MB",
    "VLLM_MEDIA_CACHE_TTL_HOURS", "VLLM_MEDIA_FETCH_MAX_RETRIES", "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
    "VLLM_MEDIA_LOADING_THREAD_COUNT", "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", "VLLM_MAX_AUDIO_DECODE_DURATION_S",
    "VLLM_MAX_AUDIO_PREPROCESS_WORKERS", "VLLM_MAX_IMAGE_PIXELS", "VLLM_VIDEO_LOADER_BACKEND", "VLLM_MEDIA_CONNECTOR",
    "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "VLLM_ASSETS_CACHE", "VLLM_ASSETS_CACHE_MODEL_CLEAN",
    "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE",
    "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_MOE_PREPACK", "VLLM_ZENTORCH_WEIGHT_PREPACK", "VLLM_TEST_FORCE_LOAD_FORMAT",
    "VLLM_ENABLE_CUDA_COMPATIBILITY", "VLLM_CUDA_COMPATIBILITY_PATH", "VLLM_SKIP_MODEL_NAME_VALIDATION",
    "VLLM_API_KEY", "VLLM_CONFIG_ROOT", "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH", "VLLM_MAX_AUDIO_DECODE_BYTES",
    "VLLM_MAX_EMBED_DECODE_BYTES", "VLLM_SKIP_VERSION_SUFFIX", "VLLM_TRITON_JIT_WARMUP_NUM_THREADS", "VLLM_XLA_CACHE_PATH",
))
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.I)


def compile_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """The VLLM_* variables of the engine's environment that vLLM's compile cache hashes (name → value; a name
    that looks like a secret's gets a digest of its value: the key's fields are written beside the archive)."""
    return {k: (f"sha256:{hashlib.sha256(v.encode()).hexdigest()[:16]}" if _SECRET.search(k) else v)
            for k, v in sorted(environ.items()) if k.startswith("VLLM_") and k not in COMPILE_ENV_IGNORED}


def compile_flags(argv: List[str]) -> Dict[str, Any]:
    """COMPILE_FLAGS the command sets (command line or --config), canonical name → values as written."""
    return A.flag_values(vllm_argv.scan_command([str(a) for a in argv]).opts, COMPILE_FLAGS)
