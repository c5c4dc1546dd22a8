"""Do ``DecodeLoopEngine`` and HF ``generate`` sample the same distribution on SmolLM2 at T = 0.7?

    python scripts/sampler_compare.py HF_DIR [ROUNDS]      # prints one JSON object

One batch of 4 arithmetic prompts, 16 samples each, ``ROUNDS`` seeds (default 3) per engine: the per-token
log-prob and entropy along the sampled trajectories (scored by the training forward at the temperature), the
completion length, the task reward and the five commonest first tokens. A first look, not a test: the two
engines draw from different random streams.
"""

from __future__ import annotations

import json
import sys
from collections import Counter


def main() -> None:
    import torch

    from rloo_lightning import RLOOModule
    from rloo_lightning.data import PromptDataModule
    from rloo_lightning.decode import DecodeLoopEngine
    from rloo_lightning.rollout import HFGenerateEngine

    torch.set_num_threads(2)
    hf_dir, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    module = RLOOModule(hf_dir, rewards={"funcs": ["rloo_lightning.tasks.arithmetic.reward"]},
                        sampling={"k": 16, "max_new_tokens": 48, "temperature": 0.7}, kl={"beta": 0.05})
    module.configure_model()
    module.log = lambda *a, **k: None
    data = PromptDataModule(tokenizer_name_or_path=hf_dir, task="arithmetic", batch_size=4, num_train_rows=2000,
                            num_val_rows=32, max_new_tokens=48)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    out = {}
    for name, engine in (("decode_loop", DecodeLoopEngine()), ("hf_generate", HFGenerateEngine())):
        module.engine = engine
        stats: dict[str, list] = {"logp": [], "entropy": [], "length": [], "reward": []}
        first: list[int] = []
        for seed in range(rounds):
            rollout = module.sample(batch, 16, seed=1000 + seed)
            module.score(rollout)
            with torch.no_grad():
                logp, entropy = module.logprobs(module.policy, rollout, with_entropy=True)
            mask = rollout.completion_mask.float()
            stats["logp"].append(((logp * mask).sum() / mask.sum()).item())
            stats["entropy"].append(((entropy * mask).sum() / mask.sum()).item())
            stats["length"].append(mask.sum(1).mean().item())
            stats["reward"].append(rollout.rewards.float().mean().item())
            first += rollout.completion_ids[:, 0].tolist()
        out[name] = {key: [round(x, 4) for x in values] for key, values in stats.items()}
        out[name]["first_tokens"] = Counter(first).most_common(5)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
