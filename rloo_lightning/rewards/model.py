"""A sequence-classification reward model as a reward function (classic RLHF).

    rewards:
      funcs:
        - class_path: rloo_lightning.rewards.model.RewardModel
          init_args: {model_name_or_path: Skywork/Skywork-Reward-V2-Qwen3-0.6B, dtype: bfloat16}

The reward model has its own tokenizer and chat template: it scores the *text* of prompt and
completion, re-tokenized, so it need not share a vocabulary with the policy (the policy's
``completion_ids`` are ignored). It is loaded on the first call, on the current CUDA device, and
lives inside the :class:`~rloo_lightning.rewards.RewardSet`, not as a submodule of the
LightningModule: it is never trained, wrapped by a strategy, moved by Lightning or saved in a
checkpoint.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Literal

import torch

from rloo_lightning.algo.logprobs import mask_positions

__all__ = ["RewardModel"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class RewardModel:
    """Score ``(prompt, completion)`` pairs with an ``AutoModelForSequenceClassification`` (one label).

    Formatting: when ``use_chat_template`` is True, or ``"auto"`` and the reward model's
    tokenizer has a chat template, the pair is rendered as
    ``[{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]`` with
    *that* template and tokenized without adding special tokens (the template has them);
    otherwise ``prompt + completion`` is tokenized with the tokenizer's special tokens.

    Pooling: the score is read at the last real token of each sequence, located from the
    attention mask that this class builds, never from pad-token ids (Hugging Face's pooling takes
    the rightmost token that is not ``pad_token_id``, which is the wrong token when
    ``pad_token == eos_token`` and the text ends with EOS). Decoder reward models (a ``score``
    head, as every ``*ForSequenceClassification`` built on a causal LM) are run in padded batches
    and their per-token head output is read through a forward hook, so left and right padding
    give the same scores as each sequence alone; other architectures (encoders such as
    DeBERTa) are scored one unpadded sequence at a time with the model's own pooling.

    Args:
        model_name_or_path: hub id or local directory of the reward model.
        tokenizer_name_or_path: its tokenizer (default: ``model_name_or_path``).
        use_chat_template: ``"auto"``: when the tokenizer has one; True requires one.
        batch_size: sequences per forward pass.
        max_length: longest sequence in tokens; longer ones are cut on the tokenizer's
            ``truncation_side`` (a warning says so). None: no limit.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"float64"``.
        device: e.g. ``"cuda:1"``; default: the current CUDA device if there is one, else CPU.
        padding_side: ``"left"`` / ``"right"``; default: the tokenizer's (the scores do not depend on it).
        trust_remote_code: executes code shipped with the model; off unless set.
    """

    #: Stay in the training process (GPU), even when the other reward functions go to workers.
    run_in_main_process = True

    def __init__(
        self,
        model_name_or_path: str,
        tokenizer_name_or_path: str | None = None,
        use_chat_template: Literal["auto", True, False] = "auto",
        batch_size: int = 8,
        max_length: int | None = None,
        dtype: str = "float32",
        device: str | None = None,
        padding_side: Literal["left", "right"] | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        if use_chat_template not in ("auto", True, False):
            raise ValueError(f"RewardModel: use_chat_template must be 'auto', true or false, got {use_chat_template!r}")
        if batch_size < 1:
            raise ValueError(f"RewardModel: batch_size must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"RewardModel: max_length must be >= 1 or None, got {max_length}")
        if dtype not in _DTYPES:
            raise ValueError(f"RewardModel: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if padding_side not in (None, "left", "right"):
            raise ValueError(f"RewardModel: padding_side must be 'left', 'right' or None, got {padding_side!r}")
        self.model_name_or_path = model_name_or_path
        self.tokenizer_name_or_path = tokenizer_name_or_path or model_name_or_path
        self.use_chat_template = use_chat_template
        self.batch_size = batch_size
        self.max_length = max_length
        self.dtype = dtype
        self.device = device
        self.padding_side = padding_side
        self.trust_remote_code = trust_remote_code
        self.model = None
        self.tokenizer = None
        self._warned_truncation = False

    # -- loading -------------------------------------------------------------------------------
    def load(self) -> RewardModel:
        """Load tokenizer and model now (done by the first call); checks the head has one label."""
        if self.model is not None:
            return self
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from rloo_lightning.models import resolve_model_path

        path = resolve_model_path(self.model_name_or_path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=self.trust_remote_code)
        if config.num_labels != 1:
            raise ValueError(
                f"reward model {self.model_name_or_path!r} has a head with num_labels={config.num_labels}; "
                "a reward model gives one score per sequence (num_labels=1)"
            )
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_path(self.tokenizer_name_or_path), trust_remote_code=self.trust_remote_code
        )
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.use_chat_template is True and not has_template:
            raise ValueError(
                f"reward model {self.model_name_or_path!r}: use_chat_template=True but its tokenizer "
                f"({self.tokenizer_name_or_path!r}) has no chat template"
            )
        self._chat = has_template and self.use_chat_template in (True, "auto")
        if self.device is not None:
            device = torch.device(self.device)
        elif torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=_DTYPES[self.dtype], trust_remote_code=self.trust_remote_code
        )
        model.to(device).eval().requires_grad_(False)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._pad_id = next(
            (i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0
        )
        if getattr(text_config, "pad_token_id", None) is None:
            # Hugging Face refuses batches > 1 without one; the pooling here does not use it.
            text_config.pad_token_id = self._pad_id
        head = getattr(model, "score", None)
        self._head = head if isinstance(head, torch.nn.Module) else None
        params = inspect.signature(model.forward).parameters
        self._forward_kwargs = {"use_cache": False} if "use_cache" in params else {}
        self._position_ids = "position_ids" in params
        self._device, self.tokenizer, self.model = device, tokenizer, model
        return self

    # -- scoring -------------------------------------------------------------------------------
    def encode(self, prompt: str, completion: str) -> list[int]:
        """Token ids of one pair, formatted for the reward model."""
        tok = self.load().tokenizer
        if self._chat:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            text = tok.apply_chat_template(messages, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt + completion, add_special_tokens=True)["input_ids"]
        if self.max_length is not None and len(ids) > self.max_length:
            if not self._warned_truncation:
                warnings.warn(
                    f"reward model {self.model_name_or_path!r}: a sequence of {len(ids)} tokens is cut to "
                    f"max_length={self.max_length} on the {tok.truncation_side}", stacklevel=2,
                )
                self._warned_truncation = True
            ids = ids[-self.max_length:] if tok.truncation_side == "left" else ids[: self.max_length]
        return ids

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]], padding_side: str | None = None) -> list[float]:
        """Scores of token sequences (already formatted), batched, read at each last real token."""
        self.load()
        side = padding_side or self.padding_side or self.tokenizer.padding_side
        out: list[float] = [0.0] * len(sequences)
        # Similar lengths together: less padding. The scores do not depend on the grouping.
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            batch = [sequences[i] for i in idx]
            if self._head is None:
                scores = [self._score_alone(seq) for seq in batch]
            else:
                scores = self._score_batch(batch, side)
            for i, s in zip(idx, scores):
                out[i] = s
        return out

    def _score_batch(self, batch: list[list[int]], side: str) -> list[float]:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, seq in enumerate(batch):
            cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
            ids[r, cols] = torch.tensor(seq, dtype=torch.long)
            attn[r, cols] = 1
        ids, attn = ids.to(self._device), attn.to(self._device)
        kwargs = dict(self._forward_kwargs)
        if self._position_ids:
            # Positions count real tokens only, so left padding does not shift them.
            kwargs["position_ids"] = mask_positions(attn)
        captured = []
        handle = self._head.register_forward_hook(lambda module, args, output: captured.append(output))
        try:
            self.model(input_ids=ids, attention_mask=attn, **kwargs)
        finally:
            handle.remove()
        logits = captured[-1] if captured else None
        if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == ids.shape):
            # The head is not applied per token here: fall back to one unpadded sequence at a time.
            self._head = None
            return [self._score_alone(seq) for seq in batch]
        last = (torch.arange(width, device=attn.device) * attn).argmax(1)  # last real token per row
        return logits[torch.arange(len(batch), device=logits.device), last, 0].float().cpu().tolist()

    def _score_alone(self, seq: list[int]) -> float:
        """No padding, so the model's own pooling (last token, or first for encoders) is right."""
        ids = torch.tensor([seq], dtype=torch.long, device=self._device)
        cfg = self.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        saved, cfg.pad_token_id = cfg.pad_token_id, None  # nothing is padding in a batch of one
        try:
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), **self._forward_kwargs).logits
        finally:
            cfg.pad_token_id = saved
        return float(logits.reshape(-1)[0])

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float | None]:
        sequences = [self.encode(p, c) for p, c in zip(prompts, completions)]
        nonempty = [i for i, s in enumerate(sequences) if s]
        scores = self.score_ids([sequences[i] for i in nonempty])
        out: list[float | None] = [None] * len(sequences)  # nothing to score: no reward
        for i, s in zip(nonempty, scores):
            out[i] = s
        return out

    def __repr__(self) -> str:
        return f"RewardModel({self.model_name_or_path!r})"

    def __getstate__(self) -> dict:
        # Copies (pickled modules, spawned processes) reload the model rather than carrying it.
        state = self.__dict__.copy()
        state["model"] = state["tokenizer"] = None
        return state
