#!/usr/bin/env bash
# llama.cpp's own tools, the reference sides of `edgerun bench`: llama-bench (the GPU scenarios),
# llama-server (`edgerun bench serve`) and llama-batched-bench (its batched decode ceiling).
#
#   scripts/build_llama_tools.sh SRC BUILD_DIR BIN_DIR [CMAKE_ARG ...]
#
# SRC is an unpacked llama-cpp-python source (setup.sh's build/llama-src): the tools are built
# from the llama.cpp it vendors, so they run the same kernels as the library edgerun loads.
# CMAKE_ARG are setup.sh's backend flags (GGML_NATIVE off, the x86 extensions this CPU lists,
# CUDA where setup.sh picked it), so the tools' ggml is compiled exactly as the library's is.
# The tree is a standalone CMake build of its own: building the tools never rebuilds or touches
# the installed llama-cpp-python. Static libraries, so each binary stands alone; no web UI and
# no HTTPS (nothing is downloaded at build time, the server is for 127.0.0.1). The binaries are
# linked into BIN_DIR. Jobs: CMAKE_BUILD_PARALLEL_LEVEL, else nproc.
set -euo pipefail
src=${1:?SRC (an unpacked llama-cpp-python source) is required}
build=${2:?BUILD_DIR is required}
bin=${3:?BIN_DIR is required}
shift 3
llama="$src/vendor/llama.cpp"
[ -f "$llama/CMakeLists.txt" ] || { echo "build_llama_tools: no llama.cpp under $src/vendor" >&2; exit 1; }
tools=(llama-bench llama-server llama-batched-bench)
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S "$llama" -B "$build" ${generator[@]+"${generator[@]}"} -DCMAKE_BUILD_TYPE=Release "$@" \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF >/dev/null
cmake --build "$build" --target "${tools[@]}" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >/dev/null
mkdir -p "$bin"
for tool in "${tools[@]}"; do
  found=$(find "$build" -type f -name "$tool" -perm -u+x | head -1)
  [ -n "$found" ] || { echo "build_llama_tools: $tool was not built in $build" >&2; exit 1; }
  ln -sf "$(realpath "$found")" "$bin/$tool"
done
