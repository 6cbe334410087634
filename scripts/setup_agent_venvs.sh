#!/usr/bin/env bash
# Create or refresh the virtualenvs of example agents whose libraries conflict with .venv; a no-op
# when nothing changed. Each one is small: its own site-packages come first, .venv's after (a .pth
# file), so it holds only what its library needs beyond .venv.
#   .venv-verifiers   verifiers 0.4.0 (needs openai<3; .venv has openai 3): examples/agents/verifiers_calculator.py
# Needs .venv (scripts/setup_venv.sh). Prints one line.
set -euo pipefail
cd "$(dirname "$0")/.."

MAIN_PYTHON=.venv/bin/python
VENV=.venv-verifiers
STAMP=$VENV/.asyncrl-installed
REQUIREMENT=verifiers==0.4.0
# What pip installed beyond .venv for verifiers 0.4.0 (with -c constraints.txt), pinned.
PINS="aiofiles==25.1.0
connectrpc==0.11.1
gepa==0.1.4
latex2sympy2_extended==1.11.0
math-verify==0.9.0
mcp==2.0.0
mcp-types==2.0.0
openai==2.54.0
openai-harmony==0.0.8
prime-pydantic-config==0.4.3
prime-runs==0.1.4
prime-sandboxes==0.5.1
prime-traces==0.0.10
prime-tunnel==0.1.15
protobuf-py==0.1.1
protobuf-py-ext==0.1.1
pyqwest==0.12.0
renderers==0.1.12
tenacity==9.2.1
tomli==2.5.0
tomli_w==1.2.0"

if [ ! -x "$MAIN_PYTHON" ]; then
  echo "setup_agent_venvs: $MAIN_PYTHON not found; run scripts/setup_venv.sh first" >&2
  exit 1
fi
# Re-create only when what we would install changed (our pins, .venv's pins and packages).
want=$(cat <(echo "$REQUIREMENT") <(echo "$PINS") constraints.txt setup.py | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup_agent_venvs: $VENV up to date ($REQUIREMENT)"
  exit 0
fi

rm -rf "$VENV"
"$MAIN_PYTHON" -m venv "$VENV"
site() { "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
site "$MAIN_PYTHON" > "$(site "$VENV/bin/python")/asyncrl-main-venv.pth"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# pip sees .venv's packages (through the .pth) as installed and keeps them there; it reports
# .venv's own packages that want openai 3 as conflicts, which do not matter here: only on failure
# is its output shown.
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --progress-bar off \
    -c constraints.txt -c <(echo "$PINS") "$REQUIREMENT" >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup_agent_venvs: installing $REQUIREMENT into $VENV failed (above)" >&2
  exit 1
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as metadata, pathlib, sys, sysconfig
own = pathlib.Path(sysconfig.get_path("purelib"))
openai, verifiers = metadata.distribution("openai"), metadata.distribution("verifiers")
assert openai.version.startswith("2.") and pathlib.Path(openai.locate_file("")) == own, openai.locate_file("")
assert pathlib.Path(metadata.distribution("transformers").locate_file("")) != own  # .venv's
added = sum(1 for _ in own.glob("*.dist-info")) - 2  # less pip and setuptools
print(f"setup_agent_venvs: made .venv-verifiers: verifiers {verifiers.version}, openai {openai.version}"
      f" ({added} packages over .venv)")
EOF
echo "$want" > "$STAMP"
