#!/usr/bin/env bash
# Build FlashInfer 0.7.2's decode kernels for sm_90a HERE (CPU only, nvcc 13.0) and pack an
# offline carry for the GPU machine into OUT (default .gpu-stage/fi).
#
# Why: scripts/peer_decode.py times FlashInfer's tensor-core paged decode and TensorRT-LLM's XQA
# (through FlashInfer) beside kvq. The GPU machine reaches no package registry, and compiling
# these kernels there would eat its lent time, so they are compiled here and shipped as FlashInfer
# AOT artifacts, flashinfer/data/aot/<name>/<name>.so, which it loads instead of JIT-compiling.
#
# What: pages of 16, bf16 queries and output, bf16 or FP8 E4M3 KV caches (18 modules):
#   fa2:KV[:D] batch prefill, which BatchPrefillWithPagedKVCacheWrapper(backend="fa2") and
#              BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) run, head_dim D
#              (default 128; 64 and 256 for the grid's gqa-d64 / gqa-d256)
#   fa2i:KV    its stride-independent twin (used when K and V have different strides)
#   fa3:bf16   batch prefill on FlashAttention-3's Hopper kernels (backend="fa3"), head_dim 128
#   fa3q8:e4m3 the same with FP8 E4M3 queries and cache (FP8 tensor cores; fa3 takes an FP8
#              cache only with an FP8 query)
#   xqa:KV:G   XQA at head_dim 128, GQA group G compiled in: 1, 4 and 6
#   dec:KV     the CUDA-core decode (use_tensor_cores=False)
# MODULES="xqa:bf16:4 ..." builds only those (default: all).
#
# Cost on a 2-core machine, one nvcc at a time (MAX_JOBS=1): ~130-150 s per fa2 module, ~75 s
# per fa2i, ~620 s per fa3, ~16 s per XQA, ~30 s per dec, so ~40 min in all, after ~2 min
# installing a ~5 GB build venv (PyPI's torch 2.11.0 and its CUDA wheels; only its CPU side is
# used). A rerun with the same WORK recompiles nothing. The carry is ~22 MB.
#
# On the GPU machine (Python 3.12, torch in /opt/torch/.venv), from the repo root:
#   bash .gpu-stage/fi/install.sh && source /tmp/site/fi_env.sh
#   python3 scripts/peer_decode.py
#
# Usage: scripts/stage-flashinfer.sh [OUT [WORK]]   WORK (default /tmp/kvq-flashinfer) is reused.
# nvcc: $CUDA_HOME if set, else nvcc on PATH or $NVCC, else shared/device/cuda-toolkit.sh.
# PYTHON (default python3) makes the build venv; its version does not matter to the modules.
# shellcheck disable=SC2030,SC2031  # each step sets its environment in a subshell, on purpose
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:-$root/.gpu-stage/fi}")
work=$(realpath -m "${2:-/tmp/kvq-flashinfer}")
modules=${MODULES:-fa2:bf16 fa2:e4m3 fa2:bf16:64 fa2:e4m3:64 fa2:bf16:256 fa2:e4m3:256 fa2i:bf16 fa2i:e4m3 fa3:bf16 fa3q8:e4m3 xqa:bf16:1 xqa:bf16:4 xqa:bf16:6 xqa:e4m3:1 xqa:e4m3:4 xqa:e4m3:6 dec:bf16 dec:e4m3}
log() { echo "stage-flashinfer: $*" >&2; }

# Pins. The carry's wheels are for the GPU machine's CPython 3.12; install.sh installs tvm-ffi
# always and each small dependency only where that python lacks it.
flashinfer="flashinfer-python==0.7.2"
tvm_ffi="apache-tvm-ffi==0.1.15.post2"
small=(einops==0.8.2 click==8.5.1 tabulate==0.10.0 tqdm==4.70.1 requests==2.34.2 urllib3==2.8.0
       idna==3.21 certifi==2026.10.19.post1 charset-normalizer==3.5.3 packaging==26.4
       nvidia-ml-py==13.615.71)
mkdir -p "$work"

# --- nvcc 13.0 -------------------------------------------------------------------------------
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -z "${NVCC:-}" ] && ! command -v nvcc >/dev/null 2>&1; then
    if [ -f "$root/../shared/device/cuda-toolkit.sh" ]; then
      # shellcheck source=/dev/null
      source "$root/../shared/device/cuda-toolkit.sh"
    else eval "$("$root/scripts/install-cuda-toolkit.sh")"; fi
  fi
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "${NVCC:-$(command -v nvcc)}")")")}
fi
toolkit=$CUDA_HOME
log "nvcc: $("$toolkit/bin/nvcc" --version | grep -o 'release [0-9.]*, V[0-9.]*')"

# FlashInfer links every module with -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda.
# NVIDIA's wheels keep the libraries in lib/, with no unversioned libcudart.so and no driver
# stub, so FlashInfer gets a CUDA_HOME of symlinks to the toolkit with those two added.
cuda=$work/cuda
rm -rf "$cuda"; mkdir -p "$cuda/lib64/stubs"
for d in bin nvvm; do
  if [ -e "$toolkit/$d" ]; then ln -s "$toolkit/$d" "$cuda/$d"; fi
done
# include/: the toolkit's headers, one link each, so that curand's can join them below.
mkdir "$cuda/include"
for f in "$toolkit"/include/*; do ln -s "$f" "$cuda/include/"; done
libdir=$toolkit/lib64; [ -d "$libdir" ] || libdir=$toolkit/lib
for f in "$libdir"/*; do
  if [ "${f##*/}" != stubs ]; then ln -s "$f" "$cuda/lib64/"; fi
done
[ -e "$cuda/lib64/libcudart.so" ] || ln -s "$libdir/libcudart.so.13" "$cuda/lib64/libcudart.so"
# The driver: empty entry points under its soname, enough to link against (the XQA modules
# import cuGetErrorName and cuTensorMapEncodeTiled) and to dlopen the modules in the check below;
# the GPU machine loads its real libcuda.so.1.
cat > "$work/stub.c" <<'EOF'
int cuGetErrorName(void){return 0;}
int cuGetErrorString(void){return 0;}
int cuTensorMapEncodeTiled(void){return 0;}
int cuGetProcAddress(void){return 0;}
int cuDriverGetVersion(void){return 0;}
EOF
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib64/stubs/libcuda.so" "$work/stub.c"
mkdir -p "$work/teststub"; ln -sf "$cuda/lib64/stubs/libcuda.so" "$work/teststub/libcuda.so.1"

# --- build venv and downloads ----------------------------------------------------------------
# FlashInfer's JIT needs torch (dtypes, the C++ ABI flag), tvm-ffi (headers), ninja and its small
# dependencies; its heavy ones (cuda-python, cutlass-dsl, cudnn-frontend, nccl4py) are not used.
venv=$work/venv
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py=$venv/bin/python
log "build venv (torch 2.11.0 and its CUDA wheels: a few GB on first run)"
"$py" -m pip install -q torch==2.11.0 "$tvm_ffi" ninja==1.13.2 numpy==2.4.6 "${small[@]}"
# The fa3 modules' sources include curand_kernel.h, which the toolkit's wheels leave out; torch's
# CUDA wheels carry curand's headers.
curand_h=$(find "$venv" -name curand_kernel.h -path '*nvidia*' | head -1)
[ -n "$curand_h" ] || { log "no curand_kernel.h in the build venv"; exit 1; }
for f in "$(dirname "$curand_h")"/curand*; do
  [ -e "$cuda/include/${f##*/}" ] || ln -s "$f" "$cuda/include/"
done
mkdir -p "$work/dl/carry"
"$py" -m pip download -q --no-deps -d "$work/dl" "$flashinfer"
"$py" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --abi cp312 --platform manylinux_2_28_x86_64 -d "$work/dl/carry" "$tvm_ffi" "${small[@]}"
# Only the flashinfer/ package (the wheel also carries the optional b12x package). Extracted
# once: fresh mtimes would make ninja rebuild every module on a rerun.
if [ ! -d "$work/src/flashinfer" ]; then
  "$py" - "$work"/dl/flashinfer_python-0.7.2-*.whl "$work/src" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("flashinfer/")])
PY
fi

# --- the modules -----------------------------------------------------------------------------
# `fi_modules build DEST KEY...` compiles each module and copies its .so to DEST/<name>/<name>.so;
# `fi_modules check - KEY...` asserts FlashInfer finds each as an AOT artifact and loads it.
fi_modules() {
  "$py" - "$@" <<'PY'
import os, shutil, sys, time
import torch
from flashinfer.jit.attention.modules import (
    _gen_batch_prefill_independent_paged_module, _gen_batch_prefill_primary_module,
    gen_batch_decode_module, gen_batch_prefill_module)
from flashinfer.jit.xqa import gen_xqa_module

bf16 = torch.bfloat16
KV = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
# No positional encoding, sliding window, logits soft cap or fp16 QK reduction.
PLAIN = dict(pos_encoding_mode=0, use_sliding_window=False, use_logits_soft_cap=False)

def spec(key):
    kind, kv, *extra = key.split(":")  # extra: XQA's group, or the others' head_dim (128)
    d = int(extra[0]) if extra and kind != "xqa" else 128
    common = dict(dtype_q=bf16, dtype_kv=KV[kv], dtype_o=bf16, dtype_idx=torch.int32,
                  head_dim_qk=d, head_dim_vo=d, **PLAIN)
    if kind in ("fa2", "fa2i"):
        gen = _gen_batch_prefill_primary_module if kind == "fa2" else _gen_batch_prefill_independent_paged_module
        return gen(backend="fa2", use_fp16_qk_reduction=False, **common)
    if kind in ("fa3", "fa3q8"):
        if kind == "fa3q8":
            common["dtype_q"] = KV[kv]
        return gen_batch_prefill_module(backend="fa3", use_fp16_qk_reduction=False, **common)
    if kind == "dec":
        return gen_batch_decode_module(**common)
    if kind == "xqa":
        return gen_xqa_module(input_dtype=bf16, kv_cache_dtype=KV[kv], page_size=16, head_dim=128,
                              head_group_ratio=int(extra[0]), use_sliding_window=False,
                              output_dtype=bf16, q_seq_len=1, use_ragged_q=False)
    sys.exit(f"unknown module {key!r}")

mode, dest, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
for key in keys:
    s = spec(key)
    if mode == "build":
        t = time.time()
        s.build(verbose=False)
        os.makedirs(os.path.join(dest, s.name), exist_ok=True)
        shutil.copy2(s.jit_library_path, os.path.join(dest, s.name, s.name + ".so"))
        print(f"built {key} in {time.time() - t:.0f} s: {s.name}", flush=True)
    else:
        assert s.is_aot, f"{key}: {s.name} is not found as an AOT artifact"
        s.build_and_load()
        print(f"loads {key} from {s.get_library_path()}", flush=True)
PY
}
read -ra keys <<<"$modules"
log "building ${#keys[@]} module(s), one nvcc at a time"
rm -rf "$work/aot"
(
  export PATH="$venv/bin:$cuda/bin:$PATH" CUDA_HOME=$cuda CUDA_PATH=$cuda PYTHONPATH=$work/src
  export FLASHINFER_WORKSPACE_BASE=$work/ws FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=1
  unset FLASHINFER_DISABLE_JIT
  fi_modules build "$work/aot" "${keys[@]}"
)

# --- strip the package -----------------------------------------------------------------------
# Keep all Python, the jinja templates, headers and sources FlashInfer reads to load or generate
# these modules (and decode/prefill/XQA in general); drop cccl, cutlass and the other kernels'
# sources (the wheel unpacks to ~450 MB, this to ~110 MB). Then add the modules as AOT artifacts.
rm -rf "$work/strip"
"$py" - "$work/src" "$work/strip" <<'PY'
import os, re, shutil, sys
src, dst = sys.argv[1:]
CU = re.compile(r"((batch|single)_(decode|prefill).*|flashinfer_xqa_binding)\.cu")

def keep(rel):
    if not rel.startswith("data/"):
        return rel.endswith(".py") or rel == "py.typed"
    rel = rel[len("data/"):]
    if rel.startswith(("include/", "spdlog/", "csrc/xqa/")):
        return True
    name = rel[len("csrc/"):]
    return rel.startswith("csrc/") and "/" not in name and (
        name.endswith((".h", ".cuh", ".jinja")) or CU.fullmatch(name) is not None)

for d, _, files in os.walk(os.path.join(src, "flashinfer")):
    for f in files:
        path = os.path.join(d, f)
        rel = os.path.relpath(path, os.path.join(src, "flashinfer"))
        if keep(rel):
            os.makedirs(os.path.dirname(os.path.join(dst, "flashinfer", rel)), exist_ok=True)
            shutil.copy2(path, os.path.join(dst, "flashinfer", rel))
PY
cp -r "$work/aot" "$work/strip/flashinfer/data/aot"

log "checking that FlashInfer loads each module as an AOT artifact, JIT disabled"
(
  export PYTHONPATH=$work/strip FLASHINFER_WORKSPACE_BASE=$work/ws-check FLASHINFER_DISABLE_JIT=1
  export FLASHINFER_CUDA_ARCH_LIST=9.0a
  export LD_LIBRARY_PATH=$work/teststub:$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi_modules check - "${keys[@]}"
)

# --- the carry -------------------------------------------------------------------------------
mkdir -p "$out"
rm -rf "$out/wheels" "$out/flashinfer_pkg.tar.xz"
mkdir "$out/wheels"
cp "$work"/dl/carry/*.whl "$out/wheels/"
XZ_OPT=-T1 tar -C "$work/strip" --sort=name --owner=0 --group=0 -cJf "$out/flashinfer_pkg.tar.xz" flashinfer

cat > "$out/install.sh" <<'EOF'
#!/usr/bin/env bash
# Offline install of the stripped FlashInfer 0.7.2 + prebuilt sm_90a AOT modules.
# Usage:  bash install.sh            (then: source /tmp/site/fi_env.sh)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PY:-/opt/torch/.venv/bin/python3}
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
# 1) tvm-ffi (required; C ABI used by all FlashInfer .so modules). Always ours (0.1.15.post2).
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$HERE"/wheels/apache_tvm_ffi-*.whl
# 2) small pure-python deps: install only those the remote python lacks
for pair in einops:einops click:click tabulate:tabulate tqdm:tqdm requests:requests urllib3:urllib3 \
            idna:idna certifi:certifi charset_normalizer:charset_normalizer packaging:packaging pynvml:nvidia_ml_py; do
  mod=${pair%%:*}; whl=${pair##*:}
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$HERE"/wheels/${whl}-*.whl
  fi
done
# 3) stripped flashinfer package (python + jinja templates + headers + data/aot/*.so)
"$PY" -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$HERE/flashinfer_pkg.tar.xz" "$SITE"
cat > "$SITE/fi_env.sh" <<EOT
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws      # writable; generated sources/logs go here
export FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_DISABLE_JIT=1                 # never compile; missing module => immediate error
export FLASHINFER_DISABLE_VERSION_CHECK=1
EOT
mkdir -p /tmp/fiws
echo "installed into $SITE; now: source $SITE/fi_env.sh"
EOF
chmod +x "$out/install.sh"

nvcc_release=$("$cuda/bin/nvcc" --version | grep -o 'V[0-9.]*' | tail -1)
{
  cat <<EOF
FlashInfer 0.7.2 offline carry for sm_90a (H100/H200), CUDA 13.0, Python 3.12, made by
scripts/stage-flashinfer.sh on a CPU-only host: nvcc $nvcc_release, FLASHINFER_CUDA_ARCH_LIST=9.0a,
-gencode=arch=compute_90a,code=sm_90a.

Contents
  flashinfer_pkg.tar.xz  stripped flashinfer package (all .py, jinja templates, csrc/xqa, data/include, spdlog)
                         + data/aot/<module>/<module>.so  (FlashInfer loads these as AOT artifacts, no JIT)
  wheels/                apache_tvm_ffi 0.1.15.post2 cp312 (required) + small deps (installed only if missing)
  install.sh             offline install into /tmp/site, writes /tmp/site/fi_env.sh

Modules (pages of 16, bf16 query and output, KV cache bf16 or FP8 E4M3; head_dim 128 unless named):
  batch_prefill_..._kv_stride_equal
      -> BatchPrefillWithPagedKVCacheWrapper(backend="fa2") and
         BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) (GQA group, mask: runtime args)
  batch_prefill_..._paged_kv_stride_independent  (only used when K and V tensors have different strides)
  batch_prefill_... (fa3 backend: bf16 query and cache, or FP8 E4M3 query and cache)
      -> BatchPrefillWithPagedKVCacheWrapper(backend="fa3")
  batch_decode_...
      -> BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False) (CUDA-core decode)
  xqa_..._head_group_ratio_{1,4,6}_...
      -> trtllm_batch_decode_with_kv_cache(backend auto/'xqa' on sm90); group size is compiled in
Not built: page sizes other than 16, fp16, sliding window, logits soft cap, XQA for q_len>1;
head_dim 64 and 256 for the fa2 path only.

Built here:
EOF
  for d in "$work"/aot/*/; do d=${d%/}; echo "  ${d##*/}"; done
  cat <<'EOF'

On the GPU machine, from the repo root:
  bash .gpu-stage/fi/install.sh && source /tmp/site/fi_env.sh && python3 scripts/peer_decode.py
  (python3 scripts/peer_prefill.py for the prefill peers)
EOF
} > "$out/README.txt"

log "done: $(du -sh "$out" | cut -f1) in $out"
ls -la "$out"
