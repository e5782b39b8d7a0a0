#!/usr/bin/env bash
# One idempotent setup from a fresh clone: .venv, llama-cpp-python built for this machine,
# edgerun installed, default models fetched. On a ready machine it takes seconds.
#
#   scripts/setup.sh                 from the network (the package index, the model hub)
#   scripts/setup.sh --bundle DIR    offline, from a bundle scripts/pack_bundle.sh wrote
#                                    (also EDGERUN_BUNDLE=DIR): pip never reaches an index, the
#                                    bundle's sdist is built, its models go into the model cache
#                                    verified against the catalog; no default model download
#
# Knobs (environment): EDGERUN_PYTHON=/path/to/python installs into that interpreter's
# environment instead of .venv (a conda env, a container image with torch); EDGERUN_LLAMA_SDIST
# builds from a local llama-cpp-python sdist; EDGERUN_LLAMA_BUILD_DIR keeps llama.cpp's build tree
# there; EDGERUN_LLAMA_BENCH=1 also builds llama.cpp's own llama-bench, llama-server and
# llama-batched-bench (scripts/build_llama_tools.sh: the same source and backend flags, a tree of
# their own in build/llama-tools, linked in build/bin), the reference sides of `edgerun bench`'s
# GPU and serve scenarios; EDGERUN_CUDA_ARCH (default: native); EDGERUN_EXTRAS (default
# dev,convert,serve,bench; a bundle's own profile offline) picks the optional dependencies;
# EDGERUN_SKIP_MODELS=1 skips the model download.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
LLAMA_CPP_VERSION=0.3.36
TORCH_VERSION=2.13.0  # for `edgerun convert`; a CPU build where the machine has one on disk

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: %s\n' "$*" >&2; exit 1; }

bundle=${EDGERUN_BUNDLE:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=${2:?--bundle needs a directory}; shift 2 ;;
    *) die "unknown argument '$1' (scripts/setup.sh [--bundle DIR])" ;;
  esac
done
extras=${EDGERUN_EXTRAS:-dev,convert,serve,bench}
if [ -n "$bundle" ]; then
  # Offline: every pip call takes the bundle's wheels and nothing else, the hub is never asked.
  [ -f "$bundle/bundle.env" ] || die "$bundle is not a bundle (no bundle.env; see scripts/pack_bundle.sh)"
  bundle=$(cd "$bundle" && pwd)
  (cd "$bundle" && sha256sum --quiet -c SHA256SUMS) >&2 || die "$bundle: files do not match its SHA256SUMS"
  # shellcheck source=/dev/null
  . "$bundle/bundle.env"
  [ "$llama_cpp_python" = "$LLAMA_CPP_VERSION" ] \
    || die "$bundle holds llama-cpp-python $llama_cpp_python; this checkout builds $LLAMA_CPP_VERSION: pack it again"
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$bundle/wheels" HF_HUB_OFFLINE=1
  : "${EDGERUN_LLAMA_SDIST:=$(echo "$bundle"/llama-cpp-python/llama_cpp_python-*.tar.gz)}"
  extras=${EDGERUN_EXTRAS:-$extras}  # the bundle's profile (bundle.env) unless asked otherwise
fi

if [ -n "${EDGERUN_PYTHON:-}" ]; then
  py="$EDGERUN_PYTHON"
  state="$root/build/setup"
else
  venv="$root/.venv"
  py="$venv/bin/python"
  state="$venv"
  if [ ! -x "$py" ]; then
    log "creating $venv"
    python3 -m venv "$venv"
  fi
fi
mkdir -p "$state"
bindir=$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')

# Pick the ggml backend. CUDA when nvcc and an NVIDIA GPU are both present. Otherwise a CPU
# build with GGML_NATIVE off: -march=native also turns on AMX, whose matmul path crashes on
# VMs that report AMX but cannot run it, so enable each x86 extension the CPU lists, never AMX.
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $cpu_flags " == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  backend=cuda
  cmake_args="-DGGML_CUDA=ON -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=${EDGERUN_CUDA_ARCH:-native}"
else
  backend=cpu
  cmake_args="-DGGML_NATIVE=OFF"
fi
if [ -n "$cpu_flags" ]; then
  cmake_args+=" -DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma)"
  cmake_args+=" -DGGML_F16C=$(onoff f16c) -DGGML_BMI2=$(onoff bmi2) -DGGML_AVX512=$(onoff avx512f)"
  cmake_args+=" -DGGML_AVX512_VBMI=$(onoff avx512vbmi) -DGGML_AVX512_VNNI=$(onoff avx512_vnni)"
  cmake_args+=" -DGGML_AVX512_BF16=$(onoff avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
# Keep the symbols of static archives private to each library. Some toolchains link libstdc++
# statically into every shared object (seen on a CUDA image whose g++ wraps its own runtime); each
# libggml/libllama then exported its own copy of libstdc++, calls bound across copies, and a model
# load crashed in iostream code whenever another extension had loaded the system libstdc++ first.
cmake_args+=" -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
cmake_args+=" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
# ggml's RPC backend (`edgerun rpc-server`, `--rpc`): one more small library, libggml-rpc
cmake_args+=" -DGGML_RPC=ON"

stamp="$state/.llama-cpp-python.stamp"
want="$LLAMA_CPP_VERSION $backend $cmake_args"
# every build carries edgerun's source patches (scripts/llama_patches.py says what and why)
patches=$(sha256sum scripts/llama_patches.py | cut -d' ' -f1)
want+=" patches=$patches"
tools_want="$want"  # what the tools' build depends on: the library's settings, not its build tree
build_dir=()
bench=${EDGERUN_LLAMA_BENCH:-0}
if [ -n "${EDGERUN_LLAMA_BUILD_DIR:-}" ]; then
  build_dir=(-C "build-dir=$EDGERUN_LLAMA_BUILD_DIR")
  want+=" build-dir=$EDGERUN_LLAMA_BUILD_DIR"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "building llama-cpp-python $LLAMA_CPP_VERSION ($backend backend; takes a few minutes)"
  if [ -n "$bundle" ]; then  # the bundle's build tools, or those already installed
    "$py" -m pip install -q scikit-build-core cmake ninja >&2
  else
    "$py" -m pip install -q --upgrade pip scikit-build-core cmake ninja >&2
  fi
  # the source is always the patched copy in build/llama-src (which a kept build tree needs anyway:
  # a pip build of a .tar.gz unpacks it into a temporary folder)
  "$py" scripts/llama_patches.py prepare "${EDGERUN_LLAMA_SDIST:-}" "$root/build/llama-src" --version "$LLAMA_CPP_VERSION"
  echo "$patches" > "$root/build/llama-src/.edgerun-patches"
  sdist="$root/build/llama-src"
  CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$py" -m pip install --no-cache-dir --force-reinstall --no-deps --no-build-isolation --no-binary llama-cpp-python \
    ${build_dir[@]+"${build_dir[@]}"} "$sdist" >&2
  echo "$want" > "$stamp"
fi

# llama.cpp's own tools from the same source and backend flags, in a standalone tree: the
# installed library is never rebuilt for them. The sides of a comparison then run the same ggml
# kernels, so it compares decode paths and servers, not builds. Rebuilt when the library's build
# settings change (the tools tree's stamp); on 2 cores the first build takes about 10 minutes.
tools_dir="$root/build/llama-tools"
tools_ok() { for t in llama-bench llama-server llama-batched-bench; do [ -x "$root/build/bin/$t" ] || return 1; done; }
if [ "$bench" = 1 ] && { [ "$(cat "$tools_dir/.stamp" 2>/dev/null)" != "$tools_want" ] || ! tools_ok; }; then
  log "building llama-bench, llama-server and llama-batched-bench in $tools_dir"
  src="$root/build/llama-src"
  if ! grep -qx "Version: $LLAMA_CPP_VERSION" "$src/PKG-INFO" 2>/dev/null \
     || [ "$(cat "$src/.edgerun-patches" 2>/dev/null)" != "$patches" ]; then
    "$py" scripts/llama_patches.py prepare "${EDGERUN_LLAMA_SDIST:-}" "$src" --version "$LLAMA_CPP_VERSION"
    echo "$patches" > "$src/.edgerun-patches"
  fi
  rm -f "$tools_dir/.stamp"
  # shellcheck disable=SC2086  # cmake_args is a list of -D flags without spaces
  PATH="$bindir:$PATH" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    scripts/build_llama_tools.sh "$src" "$tools_dir" "$root/build/bin" $cmake_args
  echo "$tools_want" > "$tools_dir/.stamp"
fi

# edgerun itself (editable), re-installed only when pyproject.toml or native/ changed.
estamp="$state/.edgerun.stamp"
ehash=$(cat pyproject.toml models.toml $(find native -type f 2>/dev/null | sort) 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -f "$estamp" ] || [ "$(cat "$estamp")" != "$ehash" ]; then
  log "installing edgerun"
  "$py" -m pip install -q scikit-build-core pybind11 >&2
  # torch reads HF checkpoints for convert; pinned so pip takes the CPU build where one is on disk
  # instead of resolving a multi-GB CUDA build
  if [[ ",$extras," == *,convert,* ]]; then
    "$py" -c 'import torch' 2>/dev/null || "$py" -m pip install -q "torch==$TORCH_VERSION" >&2
  fi
  "$py" -m pip install -q --no-build-isolation -e ".${extras:+[$extras]}" >&2
  echo "$ehash" > "$estamp"
fi
# The checkout's bytecode, as pip writes it for a package it installs: where PYTHONDONTWRITEBYTECODE
# is set, an editable checkout is otherwise compiled afresh in every process that imports it (0.07 s
# of CPU per `edgerun` process; the test suite starts about 150). Up to date, this takes 0.2 s.
"$py" -m compileall -q -j 0 edgerun testkit >/dev/null

if [ -n "$bundle" ]; then
  # the bundle's models, copied into the cache under their catalog file names; `pull` then finds
  # them there, hashes them against the catalog and marks them verified (a mismatch is refetched,
  # which offline fails with one line naming the model)
  models_dir=$("$py" -c 'from edgerun import paths; print(paths.models_dir())')
  mkdir -p "$models_dir"
  for f in "$bundle"/models/*.gguf; do
    [ -e "$f" ] || continue
    [ -e "$models_dir/$(basename "$f")" ] || { cp "$f" "$models_dir/.$(basename "$f").partial" \
      && mv "$models_dir/.$(basename "$f").partial" "$models_dir/$(basename "$f")"; }
  done
  for name in $models; do
    "$bindir/edgerun" pull "$name" >/dev/null
  done
elif [ "${EDGERUN_SKIP_MODELS:-0}" != 1 ]; then
  "$bindir/edgerun" pull --default >/dev/null
fi
log "ready: $bindir/edgerun"
