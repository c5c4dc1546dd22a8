"""RLOOModule's option groups for what runs around the RL step: validation (``validation``), ``predict``, the policy's
loading and LoRA (``policy``), multi-turn environments (``environment``) and what a fit writes (``run``).

They are imported from :mod:`rloo_lightning.config`, with the step's groups and ``GROUPS``; each checks its own fields
when it is built and names the option in its error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rloo_lightning.options import check_choices, parse_on_error

__all__ = ["EnvironmentArgs", "PolicyArgs", "PredictArgs", "RunArgs", "ValidationArgs"]


@dataclass(frozen=True)
class ValidationArgs:
    """What a validation pass measures (``val/*``).

    Args:
        at_start: run a validation pass before the first update and log it at step 0 (Lightning's
            sanity check does not log).
        greedy: also evaluate greedy decoding: ``val/reward_greedy`` and ``val/accuracy_greedy``.
        num_samples: completions sampled per validation prompt (training sampler); ``val/reward`` is their mean.
        pass_k: log ``val/pass@<k>`` for each k (each <= ``num_samples``), with the unbiased estimator of
            Chen et al. 2021.
        success_threshold: a completion whose reward is >= this counts as a success (accuracy, pass@k).
    """

    prefix: ClassVar[str] = "validation"
    at_start: bool = True
    greedy: bool = True
    num_samples: int = 1
    pass_k: list[int] | None = None
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"validation.num_samples must be >= 1, got {self.num_samples}")
        for pk in self.pass_k or []:
            if not 1 <= pk <= self.num_samples:
                raise ValueError(f"validation.pass_k={self.pass_k}: each k must be in [1, validation.num_samples="
                                 f"{self.num_samples}]")


@dataclass(frozen=True)
class PredictArgs:
    """What ``rloo-lightning predict`` writes: completions for ``data.predict_file``, one JSON line each.

    Args:
        num_samples: completions per prompt, sampled by the training sampler (``sampling``), seeded by
            (``sampling.seed``, rank, batch).
        greedy: greedy decoding instead (then one completion per prompt).
        output_file: the JSONL file written (default ``<log dir>/predictions.jsonl``; with several
            processes each rank writes ``<name>.rank<N>.jsonl``). An existing file is not overwritten.
    """

    prefix: ClassVar[str] = "predict"
    num_samples: int = 1
    greedy: bool = False
    output_file: str | None = None

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"predict.num_samples must be >= 1, got {self.num_samples}")
        if self.greedy and self.num_samples != 1:
            raise ValueError(f"predict.greedy gives one completion per prompt; predict.num_samples="
                             f"{self.num_samples} must be 1")


@dataclass(frozen=True)
class PolicyArgs:
    """How the policy is loaded and trained.

    Args:
        gguf_file: a GGUF file inside ``model_name_or_path`` (dequantized on load; needs ``gguf``).
        trust_remote_code: executes code shipped with the model; off unless set.
        gradient_checkpointing: recompute activations in the backward of the update (less memory, one
            more forward). Generation runs in eval mode, where transformers keeps the KV cache.
        disable_dropout: turn every dropout off in the policy (and reference), so that the log-probs of
            the update are those of the sampler.
        lora: train a LoRA adapter (``peft``) instead of the whole policy: the keyword arguments of
            ``peft.LoraConfig``, e.g. ``{r: 16, lora_alpha: 32, target_modules: all-linear}``
            (``task_type`` is set here). The reference is then the base model with the adapter
            disabled; checkpoints hold the adapter (and optimizer state) only. None = full training.
        lora_export: what ``save_pretrained`` (and ``HFExport``) writes for a LoRA policy: ``merged``
            (the base with the adapter merged in) or ``adapter`` (the adapter alone).
    """

    prefix: ClassVar[str] = "policy"
    gguf_file: str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    disable_dropout: bool = True
    lora: dict | None = None
    lora_export: Literal["merged", "adapter"] = "merged"

    def __post_init__(self) -> None:
        check_choices(self)
        if self.lora is not None and (not isinstance(self.lora, dict) or not self.lora):
            raise ValueError(f"policy.lora must be a non-empty mapping of peft.LoraConfig arguments, got {self.lora!r}")
        if self.lora is not None and "task_type" in self.lora:
            raise ValueError("policy.lora: task_type is set by RLOOModule (CAUSAL_LM); remove it")


@dataclass(frozen=True)
class EnvironmentArgs:
    """Multi-turn episodes: the policy acts in an environment over several turns (see
    :mod:`rloo_lightning.environments` and ``docs/multiturn.md``). Off by default: one completion per sample,
    the paper's setting.

    Args:
        class_path: the :class:`~rloo_lightning.environments.Environment` subclass, an import path
            ``pkg.module.Class`` (importing runs its code). One instance is made per episode, with ``init_args``.
            None = single-turn.
        init_args: keyword arguments of the class.
        max_turns: the most policy turns of an episode. An episode still going after them ends, flagged
            truncated; the environment still scores it.
        max_context_tokens: the most tokens of prompt plus transcript. An episode whose next turn (of up to
            ``sampling.max_new_tokens``) could pass it ends before that turn, cut by ``context``. None = the
            model's context (its config's ``max_position_embeddings``; no limit for a model that states none).
        max_reply_tokens: the most tokens of one environment or tool message's content; a longer one is cut to
            its first ``max_reply_tokens`` tokens (``train/replies_cut`` counts them per episode).
        timeout: seconds one environment call (``reset``, ``step``, ``final_reward``, ``metrics``, ``close``) may
            run. A call past it is abandoned (it runs on in a background thread; the object is never called
            again) and its episode is scored by ``on_error``. Hung calls do not add up: with ``on_error: raise``
            the first timeout ends the step; otherwise, once a call has timed out, the rollout waits at most one
            more ``timeout`` on its calls in all, then abandons those still running and fails those not started
            (``not started``). At most ``max(16, 4 * workers)`` abandoned calls run on at once; past that a call
            fails without starting. None = no limit: a call that hangs hangs the run.
        workers: how many episodes' calls run at once, in threads (a turn's ``step`` calls, the resets, ...).
            Transcripts are the same for any number. Raise it for environments that wait (sandboxes, services);
            their state must then be their own (not shared between objects).
        on_error: what an environment failure does (an exception, a call past ``timeout``, or a malformed
            answer: an observation that is not a Message, a reward that is not a finite number): ``raise`` (an
            error naming the environment, the call, the prompt row, the sample and the turn), ``none`` (the
            episode ends with a missing reward: it leaves its group's baseline and the loss) or a number (the
            episode ends with that reward). One warning line per step counts the failures; each is logged in full
            to the ``rloo_lightning`` logger.
        reply_format: for a tokenizer without a chat template, the text appended after the policy's turn for
            an environment message: a ``str.format`` pattern with ``{content}`` (and optionally ``{role}``).
            With a chat template the template's own markers are used.

    Each episode carries ``cut_by``: ``none``, ``max_new_tokens`` (a turn, the last included, ended without an
    end-of-turn token, also when the environment ended the episode on it), ``max_turns`` or ``context``; each
    kind's share is logged as ``train/cut/<kind>``. Every cut episode is ``truncated``:
    ``shaping.mask_truncated_completions`` leaves it out of the loss and of its group's baseline. Only
    ``max_new_tokens`` counts as a missing EOS (``shaping.missing_eos_penalty``, ``train/clipped_ratio``).
    """

    prefix: ClassVar[str] = "environment"
    class_path: str | None = None
    init_args: dict = field(default_factory=dict)
    max_turns: int = 4
    max_context_tokens: int | None = None
    max_reply_tokens: int = 1024
    timeout: float | None = 60.0
    workers: int = 1
    on_error: str | float = "raise"
    reply_format: str = "\n{role}: {content}\nassistant: "

    def __post_init__(self) -> None:
        if self.class_path is not None and (not isinstance(self.class_path, str) or "." not in self.class_path):
            raise ValueError(f"environment.class_path must be an import path 'package.module.Class', got "
                             f"{self.class_path!r}")
        if not isinstance(self.init_args, dict):
            raise ValueError(f"environment.init_args must be a mapping, got {self.init_args!r}")
        if self.max_turns < 1:
            raise ValueError(f"environment.max_turns must be >= 1, got {self.max_turns}")
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            raise ValueError(f"environment.max_context_tokens must be >= 1 or null, got {self.max_context_tokens}")
        if isinstance(self.max_reply_tokens, bool) or not isinstance(self.max_reply_tokens, int) \
                or self.max_reply_tokens < 1:
            raise ValueError(f"environment.max_reply_tokens must be an integer >= 1, got {self.max_reply_tokens!r}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not math.isfinite(self.timeout) or self.timeout <= 0):
            raise ValueError(f"environment.timeout must be a number of seconds > 0, or null, got {self.timeout!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"environment.workers must be an integer >= 1, got {self.workers!r}")
        parse_on_error("environment.on_error", self.on_error)
        try:
            self.reply_format.format(role="user", content="x")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"environment.reply_format must be a str.format pattern with {{content}} (and "
                             f"optionally {{role}}), got {self.reply_format!r}: {err!r}") from None
        if "{content}" not in self.reply_format:
            raise ValueError(f"environment.reply_format must contain {{content}}, got {self.reply_format!r}")


@dataclass(frozen=True)
class RunArgs:
    """What a fit writes besides the weights' progress.

    Args:
        checkpoint_every_n_steps: besides the end of fit (always), write ``last.ckpt`` every N optimizer steps;
            0 = off.
        checkpoint_every_minutes: also write ``last.ckpt`` at the end of the first optimizer step that ends this
            many minutes after the last one written (or after training started); 0 = off. It bounds what a kill
            that leaves no time to save (``kill -9``, the out-of-memory killer, a lost node) throws away; any other
            failure writes the last finished step anyway (``docs/reliability.md``).
        time_phases: time the phases of each step (generation, reward, policy forward, reference) and write them
            as ``time/<phase>`` to the loggers.
    """

    prefix: ClassVar[str] = "run"
    checkpoint_every_n_steps: int = 0
    checkpoint_every_minutes: float = 10.0
    time_phases: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint_every_n_steps < 0:
            raise ValueError(f"run.checkpoint_every_n_steps must be >= 0, got {self.checkpoint_every_n_steps}")
        if isinstance(self.checkpoint_every_minutes, bool) or not self.checkpoint_every_minutes >= 0:
            raise ValueError(f"run.checkpoint_every_minutes must be >= 0, got {self.checkpoint_every_minutes!r}")
