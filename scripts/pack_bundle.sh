#!/usr/bin/env bash
# Pack an offline bundle for `scripts/setup.sh --bundle DIR`: everything setup needs, so a machine
# with no network (an air-gapped workstation, a GPU host that reaches nothing) sets up from it.
#
#   scripts/pack_bundle.sh [--profile full|lean] [--python 3.12] [--platform TAG ...]
#                          [--have FILE] [--models NAME,...] [--tar] OUT
#
# OUT/wheels/             a wheel of every Python dependency, for the target's Python and platform
# OUT/llama-cpp-python/   the llama-cpp-python sdist setup.sh builds, trimmed (below)
# OUT/models/             the chosen catalog models, as verified files (--models)
# OUT/bundle.env          what was packed (profile, extras, versions, models), read by setup.sh
# OUT/SHA256SUMS          every file but the models (those are checked against the catalog)
#
# Profiles: full (default) is every dependency with the dev and convert extras (pytest, torch:
# pip's configured index decides which torch build; EDGERUN_TORCH_INDEX adds one, e.g.
# https://download.pytorch.org/whl/cpu for the 200 MB CPU build instead of the CUDA one) and the
# build tools (scikit-build-core, pybind11, cmake, ninja). lean is the runtime dependencies, the
# server and the load generator, and the build tools, for running, serving and benchmarking (no
# tests, no convert).
# --have FILE leaves out distributions the target already has (`pip list --format=freeze` there,
# or one name a line): a GPU host's image with numpy, matplotlib and cmake then takes about
# 10 MB of wheels. Random-weight shapes for the GPU scenarios are not packed: they are written
# where they run (bench/shapes.py, on a scenario's first use), since a 7B shape is 4.7 GB.
#
# The sdist is the one pip serves (76 MB), less what a build never reads: llama.cpp's docs, test
# models and vocabularies, tests and examples (llama-server's CMake reads tools/ui even with the UI
# off, so that stays). setup.sh applies its
# patch (scripts/llama_patches.py) to it at build time; packing checks that the patch applies.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${EDGERUN_PACK_PYTHON:-python3}
profile=full target_py="" have="" models="" tar=0 out="" platforms=()
usage() { sed -n 4,5p "${BASH_SOURCE[0]}" | sed 's/^# //' >&2; exit 2; }
die() { printf 'pack_bundle: %s\n' "$*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=${2:?}; shift 2 ;;
    --python) target_py=${2:?}; shift 2 ;;
    --platform) platforms+=("${2:?}"); shift 2 ;;
    --have) have=${2:?}; shift 2 ;;
    --models) models=${2:?}; shift 2 ;;
    --tar) tar=1; shift ;;
    -h|--help) usage ;;
    -*) die "unknown option $1" ;;
    *) [ -z "$out" ] || usage; out=$1; shift ;;
  esac
done
[ -n "$out" ] || usage
case "$profile" in full) extras=dev,convert,serve,bench ;; lean) extras=serve,bench ;; *) die "--profile is full or lean, not '$profile'" ;; esac
[ -z "$have" ] || [ -f "$have" ] || die "--have $have: no such file"
pin() { sed -n "s/^$1=\([^ ]*\).*/\1/p" "$root/scripts/setup.sh"; }
llama_version=$(pin LLAMA_CPP_VERSION)
torch_version=$(pin TORCH_VERSION)
[ -n "$llama_version" ] || die "no LLAMA_CPP_VERSION in scripts/setup.sh"

mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -rf "$out/wheels" "$out/llama-cpp-python" "$out/models"
mkdir -p "$out/wheels" "$out/llama-cpp-python" "$out/models"
log() { printf 'pack_bundle: %s\n' "$*" >&2; }

# The requirements: edgerun's own (pyproject.toml, with the profile's extras), llama-cpp-python's
# runtime ones (it is built from source, not downloaded as a wheel) and the build tools.
reqs="$out/requirements.txt"
"$py" - "$root/pyproject.toml" "$extras" "$torch_version" >"$reqs" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = [r for r in project["dependencies"] if not r.startswith("llama-cpp-python")]
for extra in filter(None, sys.argv[2].split(",")):
    reqs += project["optional-dependencies"][extra]
# setup.sh pins torch (one build, not whatever is newest); llama-cpp-python's own needs
reqs = [f"torch=={sys.argv[3]}" if r.startswith("torch") else r for r in reqs]
reqs += ["typing-extensions>=4.5", "diskcache>=5.6.1", "scikit-build-core>=0.10", "pybind11>=2.12", "cmake>=3.21", "ninja"]
print("\n".join(reqs))
EOF
target=()
if [ -n "$target_py" ]; then
  [ ${#platforms[@]} -gt 0 ] || platforms=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
  target=(--python-version "$target_py" --implementation cp)
  for p in "${platforms[@]}"; do target+=(--platform "$p"); done
fi
index=()
[ -z "${EDGERUN_TORCH_INDEX:-}" ] || index=(--extra-index-url "$EDGERUN_TORCH_INDEX")
log "downloading wheels ($profile profile${target_py:+, Python $target_py})"
"$py" -m pip download -q --only-binary=:all: ${target[@]+"${target[@]}"} ${index[@]+"${index[@]}"} \
  -r "$reqs" -d "$out/wheels" >&2

if [ -n "$have" ]; then  # distributions the target has: a wheel of one of those is left out
  "$py" - "$have" "$out/wheels" <<'EOF'
import re, sys
from pathlib import Path
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(re.split(r"[=<>@ ]", line.strip())[0]) for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")}
for wheel in Path(sys.argv[2]).glob("*.whl"):
    if norm(wheel.name.split("-")[0]) in have:
        wheel.unlink()
EOF
fi

log "llama-cpp-python $llama_version sdist (trimmed)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$llama_version" -d "$tmp" >&2
tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
src=$(echo "$tmp"/llama_cpp_python-*/)
(cd "$src" && rm -rf .git docs docker examples tests \
   && cd vendor/llama.cpp && rm -rf .github .devops benches ci conversion docs examples gguf-py media models pocs \
      skills tests convert_*.py)
"$py" "$root/scripts/llama_patches.py" prepare "$src" "$tmp/patched" --version "$llama_version" 2>/dev/null \
  || die "scripts/llama_patches.py does not apply to llama-cpp-python $llama_version"
tar -czf "$out/llama-cpp-python/llama_cpp_python-$llama_version.tar.gz" -C "$tmp" "$(basename "$src")"

if [ -n "$models" ]; then  # each pulled (and so verified) here, then copied
  for name in ${models//,/ }; do
    log "model $name"
    path=$("$root/.venv/bin/edgerun" pull "$name") || die "could not pull $name"
    cp --reflink=auto "$(readlink -f "$path")" "$out/models/$(basename "$path")"
  done
fi

cat >"$out/bundle.env" <<EOF
profile=$profile
extras=$extras
llama_cpp_python=$llama_version
python=${target_py:-$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
models="${models//,/ }"
EOF
(cd "$out" && find . -type f ! -path './models/*' ! -name SHA256SUMS | sort | xargs sha256sum >SHA256SUMS)
if [ "$tar" = 1 ]; then
  tar -cf "$out.tar" -C "$(dirname "$out")" "$(basename "$out")"
  log "wrote $out.tar"
fi
log "$out: $(du -sh "$out" | cut -f1) ($(ls "$out/wheels" | wc -l) wheels, models: ${models:-none})"
