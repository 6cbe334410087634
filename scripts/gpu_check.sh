#!/usr/bin/env bash
# The GPU path, checked in one run on a GPU machine (docs/gpu.md): a megatron-core train step in
# bf16 on CUDA against fp32 on CPU, the trainer's HF export from the GPU, and the weight broadcast
# through cupy's NCCL (scripts/gpu_check.py says what each part checks). Prints one JSON line;
# exits non-zero if any part failed or could not run. At most 8 minutes.
#
#   bash scripts/gpu_check.sh --fetch   # where pip reaches PyPI: the wheels a bare GPU machine lacks, into .whl/check/
#   bash scripts/gpu_check.sh           # on the GPU machine (PyTorch with CUDA, cupy, transformers there):
#                                       # installs .whl/check/*.whl into a private dir, then runs the check
# (.whl/check alone travels: .whl/ also holds scripts/gpu_wheels.sh's ~460 MiB. After gpu_wheels.sh's
# install there, /tmp/asyncrl-site has all of it: no wheels need to travel.)
#   bash scripts/gpu_check.sh scale [1.7b_1k,0.6b_16k]  # there: the trainer at real sizes (gpu_check.py --scale)
# The GPU machine's Python is 3.12 (GPU_PYTHON_VERSION to change it); vLLM and Ray are not needed.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(megatron-core==0.16.1 mbridge==0.15.1 hydra-core==1.3.8 omegaconf==2.3.1)
PYTHON=${PYTHON:-python3}

DIR=.whl/check
if [ "${1:-}" = --fetch ]; then
  mkdir -p "$DIR"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "${WHEELS[@]}"
  # hydra's parser runtime is published as source only: build its (pure Python) wheel here
  "$PYTHON" -m pip wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
  ls "$DIR"
  exit 0
fi

compgen -G "$DIR/*.whl" >/dev/null || DIR=.whl  # wheels fetched before they moved to .whl/check
if compgen -G "$DIR/*.whl" >/dev/null; then
  SITE=${TMPDIR:-/tmp}/asyncrl-gpu-site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$DIR"/*.whl
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
elif [ -d /tmp/asyncrl-site ]; then  # scripts/gpu_wheels.sh installed everything there
  export PYTHONPATH=/tmp/asyncrl-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ "${1:-}" = scale ]; then  # the trainer at real sizes (the trainer-scale issue): at most 10 minutes
  exec timeout 600 "$PYTHON" scripts/gpu_check.py --scale cuda ${2:+--cases "$2"}
fi
exec timeout 480 "$PYTHON" scripts/gpu_check.py
