#!/usr/bin/env bash
# vLLM 0.26.0, Ray, megatron-core and the rest of asyncrl's GPU install, carried to the lent GPU
# machine in pieces and installed there (docs/gpu.md, "Installing the engine there"). That machine
# has Python 3.12, torch 2.11.0+cu130, triton, cupy, transformers, numpy 2.5.2 and numba, and no
# registry; one command takes at most 64 MiB of files, the tracked tree included; what a command
# writes under /tmp stays while the machine is held.
#
# Here (pip reaches the registry):
#   bash scripts/gpu_wheels.sh --fetch [--slim]  # resolve, download what the machine lacks into .whl/gpu/,
#                                                # then --split
#   bash scripts/gpu_wheels.sh --split [--slim]  # (again) cut .whl/gpu/*.whl into .whl/pieces/piece-NN
#                                                # sized to ride beside the tree as it is now, + manifest.json
#   bash scripts/gpu_wheels.sh --plan            # the device calls, in order (carry + command each)
# There (repo root, one device call each, back to back, each carrying its piece and the manifest):
#   bash scripts/gpu_wheels.sh --take N          # piece N, checked, into /tmp/asyncrl-pieces/
#   bash scripts/gpu_wheels.sh --assemble        # every hash checked, joined, installed into /tmp/asyncrl-site
#                                                # (pip --no-index --no-deps), then --check
#   bash scripts/gpu_wheels.sh --check [MOD[==V] ...]  # one JSON line: each import's verdict; exit 1 if any fails
# Later commands there: export PYTHONPATH=/tmp/asyncrl-site:$PWD (scripts/gpu_run.sh does).
#
# Every wheel installs with --no-deps: the set is resolved here for that machine, and pip there
# could not resolve it (numba 0.65 and mistral-common want numpy < 2.5; the machine's numpy
# 2.5.2 and numba stay). Left out (GPU_WHEELS_LEAVE_OUT): kernel packages vLLM imports only for
# features this project does not use on Hopper, each behind vLLM's own has_*() check.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS_DIR:-.whl/gpu}
PIECES=${GPU_PIECES_DIR:-.whl/pieces}
DEST=${GPU_PIECES_TMP:-/tmp/asyncrl-pieces}
SITE=${ASYNCRL_GPU_SITE:-/tmp/asyncrl-site}
HELPER=scripts/gpu_wheels.py
MIB=$((1024 * 1024))

# What the GPU run imports (setup.py's REQUIRES less wandb and datasets, imported only when asked
# for: the run turns wandb off), resolved for the GPU machine.
REQUIREMENTS=(vllm==0.26.0 "ray[default]==2.60.0" megatron-core==0.16.1 mbridge==0.15.1 hydra-core==1.3.8
  omegaconf==2.3.1 reasoning-gym==0.1.25 jsonschema==4.26.0 pyseccomp==0.1.2 fastapi uvicorn httpx msgspec
  psutil matplotlib tqdm)
# The machine's versions, so that the resolution matches what is there.
GPU_CONSTRAINTS=(torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 triton==3.6.0 transformers==5.17.0)
# Published as source only: built here into wheels (pycosat is C: built by a Python 3.12).
SDIST_ONLY_PURE=(antlr4-python3-runtime==4.9.3 cellpylib==2.4.0 zss==1.2.0)
SDIST_ONLY_CP312=(pycosat==0.6.6)
# Not carried (~510 MiB): MLA kernels for DeepSeek-style attention (tokenspeed), the CuTe DSL and
# what needs it (Blackwell FA4, quack, humming; with the CUDA compiler wheels they bring), tilelang
# (mHC kernels) and z3, video and audio decoding.
LEAVE_OUT=${GPU_WHEELS_LEAVE_OUT:-"tokenspeed-mla tokenspeed-triton nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base
  nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13 nvidia-cuda-nvdisasm
  cuda-python quack-kernels humming-kernels nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-cccl tilelang
  z3-solver torch-c-dlpack-ext pynvvideocodec torchcodec"}
# --slim: what the GPU run never loads, cut out of two wheels (~180 MB: 16 pieces -> 10): vLLM's
# FlashAttention-2 kernels (on Hopper vLLM takes FlashAttention-3, fa_utils.get_flash_attn_version;
# FA2 is imported inside a try), its Rust frontend binary (opt-in: VLLM_RUST_FRONTEND_PATH), its
# deep_gemm builds for Python 3.13 and 3.14, and Ray's Java workers' jar. The cut wheels go to
# .whl/gpu-slim/ (the rest hard-linked); .whl/gpu/ keeps the published ones.
# Untested on the machine until a session runs it (docs/gpu.md).
SLIM=("vllm-0.26.0-*.whl vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs
  vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so"
  "ray-2.60.0-*.whl ray/jars/ray_dist.jar")

platforms() {
  local n
  for n in $(seq 5 39); do printf -- '--platform manylinux_2_%s_x86_64 ' "$n"; done
  printf -- '--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 '
  printf -- '--platform linux_x86_64'
}

# Bytes of what every device call carries besides the pieces: the tracked tree and the untracked
# files git does not ignore.
tree_bytes() {
  local tracked untracked
  tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  untracked=$(git ls-files -z -o --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
  echo $((tracked + ${untracked:-0}))
}

split_pieces() {
  local tree margin limit piece
  if [ "${1:-}" = --slim ]; then make_slim; fi
  tree=$(tree_bytes)
  margin=${GPU_WHEELS_MARGIN:-$((2 * MIB))}  # the manifest, and room for the tree to grow a little
  limit=${GPU_CALL_LIMIT:-$((64 * MIB))}
  piece=${GPU_PIECE_BYTES:-$((limit - tree - margin))}
  echo "gpu_wheels: tree $((tree / 1024)) KiB, margin $((margin / 1024)) KiB: pieces of $((piece / 1024)) KiB" >&2
  GPU_WHEELS_MANIFEST_EXTRA="{\"wheels_dir\": \"$WHEELS\", \"tree_bytes\": $tree, \"margin_bytes\": $margin, \"call_limit_bytes\": $limit}" \
    "$PYTHON" "$HELPER" split "$WHEELS" "$PIECES" "$piece"
}

fetch() {
  local build_py=${GPU_BUILD_PYTHON:-} pip_py=${PIP_PYTHON:-$PYTHON}
  if [ -z "$build_py" ]; then
    for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
      if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then build_py=$c; break; fi
    done
  fi
  [ -n "$build_py" ] || { echo "gpu_wheels: a Python 3.12 is needed to build ${SDIST_ONLY_CP312[*]} (GPU_BUILD_PYTHON=...)" >&2; exit 1; }
  mkdir -p "$WHEELS"
  tmp=$(mktemp -d)  # global: the EXIT trap reads it
  trap 'rm -rf "$tmp"' EXIT
  echo "gpu_wheels: building the source-only ones: ${SDIST_ONLY_PURE[*]} ${SDIST_ONLY_CP312[*]}" >&2
  "$pip_py" -m pip wheel -q --no-deps -w "$WHEELS" "${SDIST_ONLY_PURE[@]}"
  "$build_py" -m pip wheel -q --no-deps -w "$WHEELS" "${SDIST_ONLY_CP312[@]}"
  printf '%s\n' "${GPU_CONSTRAINTS[@]}" > "$tmp/constraints.txt"
  echo "gpu_wheels: resolving for Python 3.12, manylinux x86-64 (pip ${pip_py}) ..." >&2
  # shellcheck disable=SC2046  # platforms() is one flag per word
  "$pip_py" -m pip install -q --dry-run --ignore-installed --only-binary=:all: --python-version 3.12 \
    --implementation cp $(platforms) --target "$tmp/target" --find-links "$WHEELS" -c "$tmp/constraints.txt" \
    --report "$tmp/report.json" "${REQUIREMENTS[@]}"
  # shellcheck disable=SC2086  # LEAVE_OUT: names separated by spaces
  "$PYTHON" "$HELPER" missing "$tmp/report.json" scripts/gpu_machine_packages.txt $LEAVE_OUT > "$tmp/missing.txt"
  echo "gpu_wheels: $(wc -l < "$tmp/missing.txt") wheels to carry; downloading ..." >&2
  # shellcheck disable=SC2046
  "$pip_py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $(platforms) --find-links "$WHEELS" -d "$WHEELS" -r "$tmp/missing.txt"
  # Only the resolved set: wheels of earlier fetches (other versions) would make two of one name.
  "$PYTHON" - "$WHEELS" "$tmp/missing.txt" <<'EOF'
import re, sys
from pathlib import Path
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {norm(line.split("==")[0]): line.split("==")[1] for line in Path(sys.argv[2]).read_text().split()}
for whl in Path(sys.argv[1]).glob("*.whl"):
    parts = whl.name[:-4].split("-")
    name, version, python, abi = parts[0], parts[1], parts[-3].split("."), parts[-2]
    fits = "cp312" in python or abi == "abi3" or any(p.startswith("py") for p in python)
    if want.get(norm(name)) != version or not fits:
        print(f"gpu_wheels: removing {whl.name} (not in this resolution)", file=sys.stderr)
        whl.unlink()
EOF
  echo "gpu_wheels: $(find "$WHEELS" -name '*.whl' | wc -l) wheels, $(du -sm "$WHEELS" | cut -f1) MiB" >&2
  split_pieces "$@"
}

# .whl/gpu-slim: .whl/gpu with SLIM's members cut out of their wheels.
make_slim() {
  local slim=$WHEELS-slim entry pattern members whl
  rm -rf "$slim"
  mkdir -p "$slim"
  ln -f "$WHEELS"/*.whl "$slim"/ 2>/dev/null || cp "$WHEELS"/*.whl "$slim"/
  for entry in "${SLIM[@]}"; do
    read -r -d '' pattern members <<<"$entry" || true
    for whl in "$slim"/$pattern; do
      # shellcheck disable=SC2086  # members: paths separated by blanks
      "$PYTHON" "$HELPER" slim "$whl" $members >&2
    done
  done
  WHEELS=$slim
  echo "gpu_wheels: slim: $(du -sm "$WHEELS" | cut -f1) MiB" >&2
}

case "${1:-}" in
  --fetch) shift; fetch "$@"; "$PYTHON" "$HELPER" plan "$PIECES" ;;
  --split) shift; split_pieces "$@"; "$PYTHON" "$HELPER" plan "$PIECES" ;;
  --plan) "$PYTHON" "$HELPER" plan "$PIECES" ;;
  --take) shift; [ $# -gt 0 ] || { echo "usage: $0 --take N [N ...]" >&2; exit 2; }
    "$PYTHON" "$HELPER" take "$PIECES" "$DEST" "$@" ;;
  --assemble)  # [MODULE[==VERSION] ...]: what to check after the install (default: the GPU run's)
    shift
    "$PYTHON" "$HELPER" assemble "$DEST" "$DEST/wheels" >&2
    echo "gpu_wheels: installing into $SITE ..." >&2
    rm -rf "$SITE"
    # --no-deps: see the top of this file. --no-index: nothing is fetched.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      "$DEST"/wheels/*.whl >&2
    rm -rf "$DEST/wheels"
    export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
    exec "$PYTHON" "$HELPER" check "$@" ;;
  --check)
    shift
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    if [ -d "$SITE" ]; then export PYTHONPATH=$SITE:$PYTHONPATH; fi
    exec "$PYTHON" "$HELPER" check "$@" ;;
  *) sed -n '2,24p' "$0" >&2; exit 2 ;;
esac
