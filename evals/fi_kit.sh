#!/usr/bin/env bash
# Builds .fikit/: FlashInfer 0.7.2.post1 (what vLLM 0.33.0 pins) for the lent H100/H200, which
# has Python 3.12, torch 2.11+cu130, CUDA 13.0 nvcc and no package index, with the JIT modules
# evals/bench_upstream_nvfp4.py loads compiled HERE for sm_90a (nvcc needs no GPU), so a GPU
# call spends no minutes compiling:
#   .fikit/a/   apache-tvm-ffi (the one dependency the GPU image lacks: FlashInfer imports
#               with --no-deps and the image's cuda-bindings, nvidia-ml-py, ninja, jinja2...;
#               cuda-tile, nvidia-cutlass-dsl, cudnn-frontend, nccl4py are not needed by
#               these wrappers), FlashInfer's Python package without data/ but for the module
#               generators' templates, the prebuilt modules (flashinfer/data/aot/NAME/NAME.so,
#               which FlashInfer loads without compiling), and `install`
#   .fikit/jit/ (FIKIT_JIT=1) the headers the modules compile from (from nvcc's dependency
#               files), for a GPU that must JIT after all (carry with .fikit/a)
# On the GPU: `bash .fikit/a/install /tmp/fikit` (and .fikit/jit/install), then
# PYTHONPATH=/tmp/fikit:... (evals/gpu_fi.sh does both).
#
#   bash evals/fi_kit.sh          # from the checkout; ~40 min of nvcc on 2 cores, the first time
# Needs .venv (torch 2.11, triton, apache-tvm-ffi, this package editable) and nvcc; FlashInfer is
# installed only into a scratch venv ($FIKIT_SCRATCH, default /work/scratch_fi) that sees .venv.
# Add /.fikit/ to .git/info/exclude (done below).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SCRATCH=${FIKIT_SCRATCH:-/work/scratch_fi}
FI_VERSION=0.7.2.post1
FI_WHEEL=${FI_WHEEL:-/work/src/fi/flashinfer_python-$FI_VERSION-py3-none-any.whl}
DIMS=${FIKIT_DIMS:-"128 256"}
BASE_SITE=$ROOT/.venv/lib/python3.11/site-packages
grep -qx '/.fikit/' .git/info/exclude 2>/dev/null || echo '/.fikit/' >> .git/info/exclude

# 1. the scratch venv: FlashInfer --no-deps over .venv's packages (site.addsitedir runs .venv's
#    .pth files too, so the editable vllm_nvfp4kv and evals import)
VPY=$SCRATCH/venv/bin/python
if [ ! -x "$VPY" ]; then
  "$(readlink -f .venv/bin/python)" -m venv "$SCRATCH/venv"
  echo "import site; site.addsitedir('$BASE_SITE')" \
    > "$SCRATCH"/venv/lib/python3.11/site-packages/zz_base_venv.pth
fi
if ! "$VPY" -c "import flashinfer" 2>/dev/null; then
  [ -f "$FI_WHEEL" ] || { mkdir -p "$SCRATCH/dl"; python3 -m pip download -q --no-deps \
      -d "$SCRATCH/dl" "flashinfer-python==$FI_VERSION"; FI_WHEEL=$(ls "$SCRATCH"/dl/flashinfer_python-*.whl); }
  "$VPY" -m pip install -q --no-deps "$FI_WHEEL"
  "$VPY" -m pip install -q nvidia-ml-py  # imported by flashinfer.utils (the GPU image has it)
fi
FI_SITE=$("$VPY" -c "import flashinfer, os; print(os.path.dirname(os.path.dirname(flashinfer.__file__)))")
TVM=$("$VPY" -c "import importlib.metadata as m; print(m.version('apache-tvm-ffi'))")

# 2. the modules, for sm_90a: nvcc links -lcuda, which this machine has no stub of; a stub with
#    the driver's soname (the link drops it as unneeded)
mkdir -p "$SCRATCH/stubs"
[ -f "$SCRATCH/stubs/libcuda.so" ] || { echo > "$SCRATCH/stubs/empty.c"
  gcc -shared -o "$SCRATCH/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$SCRATCH/stubs/empty.c"; }
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASHINFER_CUDA_ARCH_LIST="9.0a"
# FA3's CUTLASS headers include curand_kernel.h, which a minimal toolkit lacks: the pip
# nvidia-curand headers of .venv, through CPATH (a flag would change every module's command)
if [ ! -f "$CUDA_HOME/include/curand_kernel.h" ]; then
  mkdir -p "$SCRATCH/inc" && ln -sf "$BASE_SITE"/nvidia/cu13/include/curand*.h "$SCRATCH/inc/"
  export CPATH=$SCRATCH/inc${CPATH:+:$CPATH}
fi
export FLASHINFER_WORKSPACE_BASE=$SCRATCH/ws FLASHINFER_EXTRA_LDFLAGS="-L$SCRATCH/stubs"
rm -rf "$SCRATCH/aot" && mkdir -p "$SCRATCH/aot"
# shellcheck disable=SC2086
"$VPY" -P -m evals.bench_upstream_nvfp4 --build-fi-modules "$SCRATCH/aot" --dims $DIMS

# 3. the kit
rm -rf .fikit && mkdir -p .fikit/a
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .fikit/a "apache-tvm-ffi==$TVM"
# tvm_ffi imports typing_extensions.get_annotations (>= 4.13): installed only where the image's
# typing_extensions lacks it
mkdir -p .fikit/a/te
python3 -m pip download -q --no-deps --only-binary=:all: -d .fikit/a/te "typing-extensions>=4.13"
(cd "$FI_SITE" && { find flashinfer flashinfer_python-$FI_VERSION.dist-info -path flashinfer/data \
   -prune -o -name __pycache__ -prune -o -type f -print; ls flashinfer/data/csrc/batch_prefill* \
   flashinfer/data/csrc/page.cu flashinfer/data/csrc/flashinfer_page_binding.cu; } \
   | tar -cf - -T -) | xz -T0 -6 > .fikit/a/flashinfer-py.tar.xz
(cd "$SCRATCH" && tar -cf - aot) | xz -T0 -6 > .fikit/a/aot.tar.xz
cat > .fikit/a/install <<'EOF'
#!/usr/bin/env bash
# bash install [SITE]: FlashInfer 0.7.2.post1 + apache-tvm-ffi into SITE (default /tmp/fikit)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${1:-/tmp/fikit}
[ -f "$SITE/.fikit-a" ] && exit 0
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$HERE"/*.whl
python3 -c "from typing_extensions import get_annotations" 2>/dev/null || python3 -m pip \
  install -q --no-index --no-deps --no-compile --target "$SITE" "$HERE"/te/*.whl
tar -xJf "$HERE/flashinfer-py.tar.xz" -C "$SITE"
tar -xJf "$HERE/aot.tar.xz" -C "$SITE/flashinfer/data"
touch "$SITE/.fikit-a"
EOF

# 4. (FIKIT_JIT=1) what compiling needs: every file nvcc read from FlashInfer's data/ (the
#    dependencies ninja recorded in the builds above), the module sources
if [ "${FIKIT_JIT:-0}" = 1 ]; then
  mkdir -p .fikit/jit
  for d in "$SCRATCH"/ws/.cache/flashinfer/$FI_VERSION/90a/cached_ops/*/; do
    ninja -C "$d" -t deps
  done | grep -o "flashinfer/data/.*" | sort -u > "$SCRATCH/jit-files.txt"
  (cd "$FI_SITE" && ls flashinfer/data/csrc/*.cu flashinfer/data/csrc/*.h* flashinfer/data/csrc/*.jinja \
     2>/dev/null) >> "$SCRATCH/jit-files.txt"
  (cd "$FI_SITE" && sort -u "$SCRATCH/jit-files.txt" | tar -cf - -T -) | xz -T0 -6 \
    > .fikit/jit/data.tar.xz
  # FA3 needs curand_kernel.h: in case the GPU's toolkit lacks it too (gpu_fi.sh adds CPATH)
  tar -chf - -C "$BASE_SITE/nvidia/cu13/include" $(cd "$BASE_SITE/nvidia/cu13/include" \
    && ls curand*.h) | xz -T0 -6 > .fikit/jit/curand.tar.xz
  cat > .fikit/jit/install <<'EOF'
#!/usr/bin/env bash
# bash install [SITE]: FlashInfer's headers and sources (JIT without the prebuilt modules)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
tar -xJf "$HERE/data.tar.xz" -C "${1:-/tmp/fikit}"
mkdir -p "${1:-/tmp/fikit}/curand" && tar -xJf "$HERE/curand.tar.xz" -C "${1:-/tmp/fikit}/curand"
EOF
fi
du -sh .fikit/*
ls -la .fikit/*
