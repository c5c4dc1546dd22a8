"""Shared builders for in-process module tests: a configured RLOOModule and a scored rollout of it."""

from __future__ import annotations

import torch

from rloo_lightning import RLOOModule
from rloo_lightning.data import collate_prompts
from rloo_lightning.rollout import Rollout

REWARD = "rloo_lightning.tasks.reverse.reward"
PROMPTS = ["abc=", "hgfed=", "ab=", "gfedcba="]


def configured_module(model_dir: str, k: int = 3, **groups) -> RLOOModule:
    """An RLOOModule on ``model_dir`` (reverse-task reward, 6 new tokens) with its models loaded; logging off.

    ``groups``: option groups as dicts (``kl={"beta": 0.1}``); ``sampling`` is merged over ``k`` and 6 new tokens.
    """
    sampling = {"k": k, "max_new_tokens": 6, **groups.pop("sampling", {})}
    module = RLOOModule(model_dir, rewards={"funcs": [REWARD]}, sampling=sampling, **groups)
    module.configure_model()
    module.log = lambda *a, **kw: None
    return module


def prompt_batch(tokenizer, prompts: list[str] = PROMPTS) -> dict:
    """A collated batch of ``prompts`` as the data module makes it."""
    rows = [{"input_ids": tokenizer(p)["input_ids"], "prompt": p, "columns": {}} for p in prompts]
    return collate_prompts(rows, tokenizer.pad_token_id)


def loaded_module(path, **groups) -> RLOOModule:
    """An RLOOModule with its models loaded: the reverse reward, kl.beta 0 and 8 new tokens unless ``groups`` say."""
    defaults = {"rewards": {"funcs": [REWARD]}, "kl": {"beta": 0.0}, "sampling": {"max_new_tokens": 8}}
    groups = {**groups, **{name: {**values, **groups.get(name, {})} for name, values in defaults.items()}}
    module = RLOOModule(model_name_or_path=path, **groups)
    module.configure_model()
    return module


def answer_batch(tok, prompts) -> dict:
    """A collated batch of ``prompts``, each with its reversal as the ``answer`` column (the reverse task's)."""
    rows = [{"input_ids": tok(p)["input_ids"], "prompt": p, "columns": {"answer": p[:-1][::-1]}} for p in prompts]
    return collate_prompts(rows, tok.pad_token_id)


def scored_rollout(module: RLOOModule, seed: int = 5, reward_seed: int = 1) -> Rollout:
    """A real rollout of ``PROMPTS`` (k = the module's k) with rewards drawn uniformly from a seeded generator."""
    rollout = module.sample(prompt_batch(module.tokenizer), module.cfg.sampling.k, seed=seed)
    rollout.rewards = torch.rand(rollout.completion_ids.shape[0], generator=torch.Generator().manual_seed(reward_seed))
    return rollout


def retain_policy_logprobs(module: RLOOModule, monkeypatch) -> dict:
    """Patch ``module.logprobs`` so that the policy's log-probs with grad (and their rollout) are kept, their
    ``.grad`` retained: after ``backward``, ``kept["logp"].grad`` is the loss's gradient per token."""
    kept = {}
    logprobs = module.logprobs

    def keep(model, rollout, rows=slice(None), with_entropy=False):
        logp, entropy = logprobs(model, rollout, rows, with_entropy)
        if logp.requires_grad:
            logp.retain_grad()
            kept["logp"], kept["rollout"] = logp, rollout
        return logp, entropy

    monkeypatch.setattr(module, "logprobs", keep)
    return kept
