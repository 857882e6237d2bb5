# Sourced by the real-vLLM scripts: where the venv, models and run files live.
# Outside the checkout by default, so every checkout on a machine (and CI on a clean checkout of
# main) finds the one install: ${MARS_REAL_VLLM_HOME:-$HOME/.cache/marsproxy/real-vllm}.
REAL_VLLM_HOME="${MARS_REAL_VLLM_HOME:-${HOME:-/root}/.cache/marsproxy/real-vllm}"
