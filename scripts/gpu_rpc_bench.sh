#!/usr/bin/env bash
# The GPU measurement of the RPC backend: a 7B random-weight shape split between an rpc-server on
# this machine's GPU and one on its host CPU, edgerun's --rpc client against llama.cpp's own
# (llama-bench --rpc) on the very same split and servers, printing the ratio (goal >= 0.97).
#
#   scripts/gpu_rpc_bench.sh [OUT_JSON]      (default docs/bench/rpc-gpu.json)
#
# Needs a CUDA machine set up with llama.cpp's tools: EDGERUN_LLAMA_BENCH=1 scripts/setup.sh
# (llama-bench is then built with GGML_RPC=ON and edgerun's RPC patch, like the library). Knobs:
# EDGERUN_RPC_MEM="GPU_GIB,CPU_GIB" sets the split through the servers' --mem caps (default 3,3:
# about 16 of the 7B's 28 blocks on the GPU, 12 and the head on the CPU; the split is printed and
# in the JSON); EDGERUN_RPC_THREADS the CPU server's and the client's threads (default: physical
# cores); EDGERUN_RPC_REPEAT the replies per side (default 4). Every server it starts is stopped.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${1:-docs/bench/rpc-gpu.json}
py=${EDGERUN_PYTHON:-$root/.venv/bin/python}
bench="$root/build/bin/llama-bench"
[ -x "$bench" ] || { echo "gpu_rpc_bench: no $bench: run EDGERUN_LLAMA_BENCH=1 scripts/setup.sh" >&2; exit 1; }
threads=${EDGERUN_RPC_THREADS:-$("$py" -c 'from edgerun.settings import physical_cores; print(physical_cores())')}
# the client keeps nothing on its own GPU (--max-vram 0): both halves go through RPC, as llama-bench's do
"$py" -m edgerun.cli bench rpc --shape 7b --spawn gpu,cpu --mem "${EDGERUN_RPC_MEM:-3,3}" --max-vram 0 \
  --no-local --server-threads "$threads" --threads "$threads" --repeat "${EDGERUN_RPC_REPEAT:-4}" \
  --llama-bench "$bench" --json "$out"
