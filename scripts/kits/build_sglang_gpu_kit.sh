#!/usr/bin/env bash
# Builds, on the CPU machine, a kit that brings SGLang 0.5.16's CUDA build to the GPU machine (Python 3.12,
# torch 2.11.0+cu130 — exactly what SGLang 0.5.16 pins), in pieces small enough to send one per run.
# Self-contained: needs PyPI, python3, and zstd or the zstandard wheel; nothing from shared/ at run time.
#
# Usage (from the project root):
#   bash scripts/kits/build_sglang_gpu_kit.sh [KIT_DIR] [HELPERS_DIR]
#     KIT_DIR      default .gpu-kit-sglang (added to .git/info/exclude; never commit it)
#     HELPERS_DIR  optional folder with an unzst.py to ship instead of the copy written below
#   env: PART_MIB (48: kit MiB per run, c1's unpacker included), ZLEVEL (17), KEEP_SM100=1 (keep sgl_kernel's sm100 ops: any non-sm90 GPU needs them)
# Output: KIT_DIR/c1 (unpacker, device scripts, piece 00), KIT_DIR/c2, ... (one piece each); each cK folder
# holds at most PART_MIB MiB, so that a run (at most 64 MiB) has room for the checkout (~15 MiB) beside it.
# Sending and running it: docs/sglang-gpu.md.
#
# What is left out (docs/sglang-gpu.md says why): what the GPU machine already has (torch, triton, the CUDA
# libraries, numpy, safetensors, ...); sgl_kernel's FlashAttention 3 (flash_ops, 1 GiB unpacked), FlashMLA
# and InfLLM ops and its sm100 variant; FA4, cutlass-dsl, tilelang, helion, deep-gemm, tokenspeed and the other
# kernel packages a Llama on --attention-backend flashinfer|triton does not import; audio/video, datasets,
# modelscope, py-spy, numba, the gRPC server.
set -euo pipefail
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }  # pip, minus the local-index warnings
KIT=${1:-.gpu-kit-sglang}
HELPERS=${2:-}
PART_MIB=${PART_MIB:-48}
[ -f pyproject.toml ] || { echo "build_sglang_gpu_kit: run it from the project root" >&2; exit 2; }
grep -qx "/$KIT/" .git/info/exclude 2>/dev/null || echo "/$KIT/" >> .git/info/exclude
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
python3 -m venv "$W/pv" && quiet "$W/pv/bin/pip" install -q zstandard
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in 5 17 24 27 28 31 34 35 39; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done

# SGLang 0.5.16's dependency tree as resolved 2026-12-03 for cp312/x86_64 (pip, everything but the GPU
# machine's own packages), less the optional kernels above, plus xxhash (mxlaunch's). These exact versions
# imported sglang's server path on the CPU machine (docs/sglang-gpu.md).
cat > "$W/pins.txt" <<'PINS'
sglang==0.5.16
sglang-kernel==0.4.5
flashinfer-python==0.6.14
transformers==5.12.1
tokenizers==0.22.2
huggingface_hub==1.33.0
hf-xet==1.8.0
xgrammar==0.2.1
outlines==0.1.11
outlines_core==0.1.26
llguidance==1.9.1
apache-tvm-ffi==0.1.11
torch_c_dlpack_ext==0.1.5
torchvision==0.26.0
torch_memory_saver==0.0.10
compressed-tensors==0.20.1
cuda-python==13.4.4
cuda-bindings==13.4.4
cuda-core==1.2.2
cuda-pathfinder==1.9.1
cuda-tile==1.7.0
nvidia-cudnn-frontend==1.28.0
nvidia-ml-py==13.615.71
ninja==1.13.2
openai==2.6.1
openai-harmony==0.0.4
anthropic==2.16.0
mistral_common==1.13.1
pycountry==26.2.16
pydantic-extra-types==2.11.1
gguf==0.19.0
scipy==1.18.1
soundfile==0.13.1
cffi==2.1.1
pycparser==3.12
sentencepiece==0.2.3
tiktoken==0.14.0
pillow==13.0.0
einops==0.8.2
easydict==1.14
ipython==9.18.1
ipython_pygments_lexers==1.1.1
jedi==0.20.1
parso==0.8.7
prompt_toolkit==3.0.53
wcwidth==0.9.4
pexpect==4.9.0
ptyprocess==0.7.0
stack-data==0.6.3
executing==2.3.0
asttokens==3.0.2
pure_eval==0.2.4
traitlets==5.16.1
matplotlib-inline==0.2.2
Pygments==2.21.0
fastapi==0.165.0
starlette==1.10.0
uvicorn==0.55.0
uvloop==0.23.0
watchfiles==1.3.0
h11==0.16.0
anyio==4.16.0
sniffio==1.3.1
annotated-doc==0.0.7
python-multipart==0.0.34
httpx==0.29.0
httpcore==1.0.9
httpx2==2.16.2
httpcore2==2.16.2
truststore==0.10.5
aiohttp==3.14.5
aiohappyeyeballs==2.7.1
aiosignal==1.4.0
frozenlist==1.8.0
multidict==7.2.1
propcache==0.5.4
yarl==1.25.1
requests==2.34.2
urllib3==2.8.0
idna==3.20
certifi==2026.10.19.post1
charset-normalizer==3.5.3
pydantic==2.14.4
pydantic_core==2.50.5
annotated-types==0.8.0
typing-inspection==0.4.5
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
attrs==26.1.0
lark==1.3.1
interegular==0.3.3
airportsdata==20261103
cloudpickle==3.1.3
diskcache==5.6.3
nest-asyncio==1.6.0
dill==0.4.1
msgspec==0.23.0
orjson==3.13.0
pybase64==1.5.1
pyzmq==27.3.0
partial-json-parser==0.2.1.1.post7
setproctitle==1.3.8
prometheus_client==0.26.0
opentelemetry-api==1.45.2
protobuf==6.33.6
psutil==7.2.2
PyYAML==6.0.4
regex==2026.11.19
tqdm==4.70.1
packaging==26.4
click==8.5.1
typer==0.29.2
rich==15.0.0
markdown-it-py==4.3.0
mdurl==0.1.2
shellingham==1.5.4
loguru==0.7.3
docstring_parser==0.18.0
distro==1.9.0
tabulate==0.10.0
jiter==0.19.0
zstandard==0.25.0
xxhash==4.1.0
PINS

echo "build_sglang_gpu_kit: downloading sglang 0.5.16 and $(($(wc -l < "$W/pins.txt") - 1)) pinned dependencies"
quiet "$W/pv/bin/pip" download -q --no-deps "${PLAT[@]}" -d "$W/whl" -r "$W/pins.txt"
quiet "$W/pv/bin/pip" install -q --no-deps --no-compile --ignore-requires-python "${PLAT[@]}" --target "$W/site" \
  $(ls "$W"/whl/*.whl | grep -v /sglang_kernel-)
# sgl_kernel: `import sgl_kernel` loads only sm90/common_ops on an H200 (sm100/ on any other GPU, and with no
# GPU at all). flash_ops (FA3) is imported only by sgl_kernel.flash_attn (the fa3 attention backend),
# flashmla_ops under try/except by sgl_kernel.flash_mla, infllm_ops lazily by sgl_kernel.infllm_v2.
"$W/pv/bin/python" - "$W"/whl/sglang_kernel-*.whl "$W/site" "${KEEP_SM100:-0}" <<'PY'
import sys, zipfile
whl, dest, keep_sm100 = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
drop = {"sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so"}
with zipfile.ZipFile(whl) as z:
    for i in z.infolist():
        n = i.filename
        if n in drop or n.startswith("sgl_kernel/infllm_ops") or (n.startswith("sgl_kernel/sm100/") and not keep_sm100):
            continue
        z.extract(i, dest)
        if n.endswith(".so"):
            import os; os.chmod(os.path.join(dest, n), 0o755)
PY
# Console scripts carry this venv's python in their shebang: make them portable (ninja, which FlashInfer's
# and tvm-ffi's JIT call by name, is a binary and stays as it is).
"$W/pv/bin/python" - "$W/site/bin" <<'PY'
import sys, pathlib
for p in pathlib.Path(sys.argv[1]).iterdir():
    b = p.read_bytes()
    if b.startswith(b"#!") and b"python" in b.split(b"\n", 1)[0]:
        p.write_bytes(b"#!/usr/bin/env python3\n" + b.split(b"\n", 1)[1])
PY
# No bytecode (the device compiles it once), and no static archives: xgrammar ships a 62 MiB libxgrammar.a
# for C++ linking that nothing loads.
find "$W/site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$W/site" -name '*.a' -type f -delete
echo "build_sglang_gpu_kit: $(du -sm "$W/site" | cut -f1) MiB unpacked; compressing (zstd, long matching; several minutes)"
if command -v zstd >/dev/null; then
  (cd "$W/site" && tar cf - .) | zstd -q -T0 "-${ZLEVEL:-17}" --long=27 -o "$W/kit.tar.zst"
else
  (cd "$W/site" && tar cf - .) | "$W/pv/bin/python" -c "
import sys, zstandard
p = zstandard.ZstdCompressionParameters.from_level(${ZLEVEL:-17}, enable_ldm=True, window_log=27, threads=-1)
zstandard.ZstdCompressor(compression_params=p).copy_stream(sys.stdin.buffer, open(sys.argv[1], 'wb'))" "$W/kit.tar.zst"
fi
rm -rf "$KIT" && mkdir -p "$KIT/c1"
cp "$W"/whl/zstandard-*.whl "$KIT/c1/"

# ---- what runs on the GPU machine -------------------------------------------------------------------------
if [ -n "$HELPERS" ] && [ -f "$HELPERS/unzst.py" ]; then cp "$HELPERS/unzst.py" "$KIT/c1/unzst.py"; else
cat > "$KIT/c1/unzst.py" <<'PY'
"""Extract a .tar.zst (or several parts, concatenated in order) into a folder; needs the zstandard wheel."""
import sys, tarfile, zstandard

def main(dest, *parts):
    class Cat:
        def __init__(self, paths): self.files = [open(p, "rb") for p in paths]; self.i = 0
        def read(self, n=-1):
            out = b""
            while self.i < len(self.files) and (n < 0 or len(out) < n):
                chunk = self.files[self.i].read(-1 if n < 0 else n - len(out))
                if not chunk: self.i += 1; continue
                out += chunk
            return out
    reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(Cat(parts))
    with tarfile.open(fileobj=reader, mode="r|") as tf:
        tf.extractall(dest, filter="fully_trusted")

if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
PY
fi
cat > "$KIT/c1/sgl_step1.sh" <<'SH'
# Run 1 (sending .gpu-kit-sglang/c1), from the project root: the unpacker and piece 1 into /tmp/sgl-kit.
set -eu
K=${SGL_KIT:-.gpu-kit-sglang}
rm -rf /tmp/sgl-site /tmp/sgl-kit /tmp/sgl-zst; mkdir -p /tmp/sgl-kit
python3 -m pip install -q --no-index --no-deps --target /tmp/sgl-zst "$K"/c1/zstandard-*.whl
cp "$K"/c1/unzst.py "$K"/c1/sgl_*.sh "$K"/c1/PARTS "$K"/c1/kit.* /tmp/sgl-kit/
echo "sgl_step1: $(ls /tmp/sgl-kit/kit.* | wc -l) of $(cat /tmp/sgl-kit/PARTS) pieces in /tmp/sgl-kit"
SH
cat > "$KIT/c1/sgl_step.sh" <<'SH'
# Runs 2..N (each sending the next .gpu-kit-sglang/cK): copy the piece out of the work tree at once — a later
# run that does not send a path again removes it there; /tmp stays while the machine is up.
set -eu
cp "${SGL_KIT:-.gpu-kit-sglang}"/c*/kit.* /tmp/sgl-kit/
echo "sgl_step: $(ls /tmp/sgl-kit/kit.* | wc -l) of $(cat /tmp/sgl-kit/PARTS) pieces in /tmp/sgl-kit"
SH
cat > "$KIT/c1/sgl_env.sh" <<'SH'
# After the last piece arrived, from the project root:  source /tmp/sgl-kit/sgl_env.sh
# Then SGLang 0.5.16 (CUDA) and THIS checkout's mxlaunch (its entry points included) are importable and on PATH.
if [ ! -f /tmp/sgl-site/sglang/__init__.py ]; then
  have=$(ls /tmp/sgl-kit/kit.* 2>/dev/null | wc -l); need=$(cat /tmp/sgl-kit/PARTS 2>/dev/null || echo '?')
  [ "$have" = "$need" ] || { echo "sgl_env: $have of $need pieces in /tmp/sgl-kit — send the missing ones first"; return 1; }
  PYTHONPATH=/tmp/sgl-zst python3 /tmp/sgl-kit/unzst.py /tmp/sgl-site /tmp/sgl-kit/kit.* || return 1
  # the kit carries no bytecode: compile it once here, or every first import of a start pays for it
  python3 -m compileall -q -j 0 /tmp/sgl-site >/dev/null 2>&1
fi
# The checkout's code runs from the checkout; a dist-info folder made from pyproject.toml gives it its entry
# points (SGLang finds the in-engine plugin through them) without building a wheel.
rm -rf /tmp/mxsite && mkdir -p /tmp/mxsite/bin && python3 - <<'PY' || return 1
import tomllib, pathlib
p = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
d = pathlib.Path("/tmp/mxsite") / f"{p['name']}-{p['version']}.dist-info"
d.mkdir()
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
groups = {"console_scripts": p.get("scripts", {}), **p.get("entry-points", {})}
(d / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                                            for g, eps in groups.items()))
PY
printf '#!/usr/bin/env python3\nimport sys\nfrom mxlaunch.cli.app import main\nsys.exit(main())\n' > /tmp/mxsite/bin/mxlaunch
chmod +x /tmp/mxsite/bin/mxlaunch
# /tmp/sgl-site/bin last: the machine's own tools first; it adds `sglang` and `ninja` (FlashInfer's JIT).
export PYTHONPATH=$PWD:/tmp/mxsite:/tmp/sgl-site PATH=/tmp/mxsite/bin:$PATH:/tmp/sgl-site/bin PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}   # no network there: fail fast instead of waiting on the hub
python3 -c "
import sglang, flashinfer, sgl_kernel, mxlaunch
print('sgl_env: sglang', sglang.__version__, '| flashinfer', flashinfer.__version__, '| sgl_kernel ops', sgl_kernel.common_ops.__file__, '| mxlaunch from', mxlaunch.__file__)"
SH
# Piece 00 is smaller by what c1 carries besides it (the zstandard wheel, ~5.3 MiB, and the scripts).
echo 99 > "$KIT/c1/PARTS"
first=$(( PART_MIB * 1048576 - $(du -cb "$KIT"/c1/* | tail -1 | cut -f1) - 65536 ))
head -c "$first" "$W/kit.tar.zst" > "$W/kit.00"
tail -c +$((first + 1)) "$W/kit.tar.zst" | split -b "${PART_MIB}M" -d --numeric-suffixes=1 - "$W/kit."
[ -s "$W/kit.01" ] || rm -f "$W/kit.01"
n=$(ls "$W"/kit.[0-9]* | wc -l); echo "$n" > "$KIT/c1/PARTS"
i=1; for p in "$W"/kit.[0-9]*; do mkdir -p "$KIT/c$i"; mv "$p" "$KIT/c$i/"; i=$((i+1)); done
du -sh "$KIT"/c*
# A run carries at most 64 MiB: its piece plus the checkout's tracked and unignored files.
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r stat -c %s 2>/dev/null \
        | awk '{s += $1} END {printf "%d", s / 1048576 + 1}')
[ -d shared ] && tree=$((tree + $(du -sm shared | cut -f1)))
[ $((PART_MIB + tree)) -le 64 ] || echo "build_sglang_gpu_kit: WARNING a piece ($PART_MIB MiB) + this checkout ($tree MiB) > 64 MiB: lower PART_MIB" >&2
echo "build_sglang_gpu_kit: done — $(du -cm "$KIT"/c*/kit.* | tail -1 | cut -f1) MiB in $n pieces, $n runs to send it (docs/sglang-gpu.md)"
