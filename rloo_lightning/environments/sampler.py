"""The multi-turn rollout behind ``RLOOModule.sample``: :class:`EpisodeSampler` makes ``k`` episodes per prompt,
plays them through the module's engine (:func:`~rloo_lightning.environments.episodes.run_episodes`) with every
environment call guarded (:class:`~rloo_lightning.environments.calls.EnvCalls`), and returns them as a
:class:`~rloo_lightning.rollout.Rollout` with its :class:`~rloo_lightning.rollout.Episodes` record.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Callable, Sequence

import torch
from torch import Tensor

from rloo_lightning.environments.base import EnvironmentConfigError, Environment
from rloo_lightning.environments.calls import EnvCalls, EpisodeError, call_error, check_metrics, check_reward
from rloo_lightning.environments.episodes import (
    LiveEpisode,
    abandon_cut_off,
    assemble_transcripts,
    end_failed,
    run_episodes,
    transcript_logps,
)
from rloo_lightning.environments.turns import TurnFormat

logger = logging.getLogger(__name__)
# The package's logger prints nothing by itself (a library's logger: the application sets up its handlers). Each
# environment failure is logged there in full; the console gets one warning line per step.
logging.getLogger("rloo_lightning").addHandler(logging.NullHandler())

__all__ = ["EPISODE_METRICS", "EpisodeSampler", "EpisodeWarning", "import_environment"]


class EpisodeSampler:
    """Step 1 of a multi-turn rollout: k episodes per prompt, played through the module's engine.

    Made by :class:`~rloo_lightning.RLOOModule` from ``model.environment``
    (:class:`~rloo_lightning.config.EnvironmentArgs`). The environment class is imported, and its ``init_args``
    checked (:meth:`Environment.check_init_args`), at construction, so a wrong path, a wrong argument or a tool that
    cannot be imported fails before any model is loaded.

    Every call to an environment (``reset``, ``step``, ``final_reward``, ``metrics``, ``close``) is guarded: an
    exception, a call past ``environment.timeout`` or a malformed answer becomes an :class:`EpisodeError` naming the
    environment, the call, the prompt row, the sample and the turn, and ``environment.on_error`` decides what it does.
    A step's failures make one warning line with their counts; each failure goes in full to the ``rloo_lightning``
    logger.
    """

    columns = ("transcript",)  # what a multi-turn rollout adds to the data's columns for the reward functions

    def __init__(self, args) -> None:
        from rloo_lightning.config import parse_on_error

        self.args = args
        self.env_class = import_environment(args.class_path, "environment.class_path")
        self.env_class.check_init_args(dict(args.init_args))
        reserved = set(self.env_class.metric_names) & set(EPISODE_METRICS)
        if reserved:
            raise EnvironmentConfigError(f"environment {args.class_path}: metric_names {sorted(reserved)} are the "
                                         "package's own per-episode metrics; rename them")
        self.on_error = parse_on_error("environment.on_error", args.on_error)
        self.calls = EnvCalls(args.timeout, args.workers)
        self._format: TurnFormat | None = None

    def check_data(self, datamodule) -> None:
        """The environment against the data module (:meth:`Environment.check_data`), before any model loads."""
        self.env_class.check_data(dict(self.args.init_args), datamodule)

    def new_environment(self) -> Environment:
        try:
            return self.env_class(**self.args.init_args)
        except Exception as err:
            raise EnvironmentConfigError(f"environment {self.args.class_path}(**{self.args.init_args!r}) raised "
                                         f"{type(err).__name__}: {err}") from err

    def turn_format(self, tokenizer) -> TurnFormat:
        if self._format is None:
            self._format = TurnFormat.from_tokenizer(tokenizer, plain=self.args.reply_format)
        return self._format

    def sample(self, using, batch: dict, k: int, generation_config, seed: int):
        """The rollout of ``k`` episodes for each prompt of ``batch``, seeded by ``seed``, played with ``using``'s
        policy and engine (the :class:`~rloo_lightning.rollout.Sampler` protocol).

        Episode ``(row r, sample j)`` is reset with ``derive_seed(seed, "env", r, j)``, ``r`` the prompt's row in
        its source (``batch["row_index"]``): ``seed`` itself comes from (sampling.seed, rank, step), so a resumed
        run replays its episodes exactly. Turn ``t`` samples with ``seed`` (t = 0) or ``derive_seed(seed, "turn",
        t)``.
        """
        from rloo_lightning.engines.hf_generate import generates_synced
        from rloo_lightning.models import config_context
        from rloo_lightning.rollout import Episodes, Rollout, normal_tensor, derive_seed, eos_list

        model, tokenizer, engine, grad_free, reduce = (using.model, using.tokenizer, using.engine, using.grad_free,
                                                       using.reduce)
        n = batch["input_ids"].shape[0]
        prompt_ids = batch["input_ids"].repeat_interleave(k, dim=0)
        prompt_mask = batch["attention_mask"].repeat_interleave(k, dim=0)
        rows = batch.get("row_index")
        rows = rows.tolist() if isinstance(rows, Tensor) else list(rows) if rows is not None else list(range(n))
        columns = batch["columns"]
        if "transcript" in columns:  # self.columns
            raise ValueError("the data set has a column 'transcript', which multi-turn rollouts fill with each "
                             "episode's messages: rename the column")
        eos = eos_list(generation_config)
        fmt = self.turn_format(tokenizer)
        where = [f"prompt row {rows[i // k]} ({batch['prompt'][i // k]!r:.80}), sample {i % k}" for i in range(n * k)]
        budget = self.args.max_context_tokens or config_context(getattr(model, "config", None))
        failures = _Failures(self.args.class_path, n * k, self.on_error)
        on_error = None if self.on_error[0] == "raise" else failures.add
        episodes = [LiveEpisode(self.new_environment()) for _ in range(n * k)]
        self.calls.new_rollout()  # hung calls of this rollout share one more timeout (EnvCalls)

        def guarded(call: str, todo: list[int], make: Callable[[LiveEpisode, int], Callable[[], object]],
                    check: Callable[[object], str | None], at: Callable[[int], str]) -> dict[int, object]:
            """Run ``call`` on the episodes ``todo``; the well-formed results by episode, failures to ``on_error``."""
            out = {}
            results = self.calls.run([make(episodes[i], i) for i in todo], fail_fast=on_error is None)
            abandon_cut_off(episodes, todo, results)
            for i, (status, value) in zip(todo, results):
                if status == "cut off":  # on_error raise: another call failed, and raises below
                    continue
                ep = episodes[i]
                error = call_error(ep.env, call, status, value, check(value) if status == "ok" else None, at(i),
                                   self.calls.timeout)
                if error is None:
                    out[i] = value
                    continue
                end_failed(ep, i, error, on_error, value)
            return out

        def row_of(i: int) -> dict:
            return {"prompt": batch["prompt"][i // k], **{c: v[i // k] for c, v in columns.items()},
                    "row_index": rows[i // k], "sample_index": i % k}

        def generate(ids: Tensor, mask: Tensor, turn: int):
            with grad_free:
                out = engine.generate(model, tokenizer, ids, mask, generation_config,
                                      seed if turn == 0 else derive_seed(seed, "turn", turn))
            return tuple(normal_tensor(t) for t in out) if isinstance(out, (tuple, list)) else normal_tensor(out)

        device = prompt_ids.device
        keep_going = None
        if reduce is not None and generates_synced(model):
            keep_going = lambda live: bool(reduce(torch.tensor(float(live), device=device), "max") > 0)  # noqa: E731
        names = tuple(self.env_class.metric_names)
        try:
            guarded("reset", list(range(n * k)),
                    lambda ep, i: lambda: ep.env.reset(row_of(i), derive_seed(seed, "env", rows[i // k], i % k)),
                    lambda value: None, lambda i: f"on {where[i]}, at reset")
            run_episodes(generate, tokenizer, prompt_ids, prompt_mask, episodes, fmt, eos,
                         int(generation_config.max_new_tokens), self.args.max_turns, budget, where,
                         on_error=on_error, keep_going=keep_going, calls=self.calls,
                         max_reply_tokens=self.args.max_reply_tokens)
            scored = [i for i, ep in enumerate(episodes) if not ep.failed]
            finals = guarded("final_reward", scored, lambda ep, i: lambda: ep.env.final_reward(ep.truncated),
                             check_reward, lambda i: f"on {where[i]}, after turn {episodes[i].turns - 1}")
            for i, value in finals.items():
                episodes[i].env_reward += float(value)
            measured = guarded("metrics", [i for i, ep in enumerate(episodes) if not ep.failed],
                               lambda ep, i: ep.env.metrics, lambda value: check_metrics(value, names),
                               lambda i: f"on {where[i]}, after turn {episodes[i].turns - 1}")
        finally:
            self._close(episodes, where)
        failed = math.nan if self.on_error[1] is None else self.on_error[1]  # on_error's score
        env_rewards = [failed if ep.failed else ep.env_reward for ep in episodes]
        env_metrics = {name: torch.tensor([float(measured[i].get(name, 0.0)) if i in measured else math.nan
                                           for i in range(len(episodes))]) for name in names}
        env_metrics["replies_cut"] = torch.tensor([float(ep.replies_cut) for ep in episodes])
        failures.report()
        ids, policy, context = assemble_transcripts(episodes, tokenizer.pad_token_id if tokenizer.pad_token_id
                                                    is not None else eos[0], device)
        final = [next((seg for seg, is_policy in reversed(ep.segments) if is_policy), []) for ep in episodes]
        transcripts = [list(ep.messages) for ep in episodes]
        record = Episodes(context_mask=context, final_turn_ids=final,
                          rewards=torch.tensor(env_rewards, dtype=torch.float32, device=device),
                          turns=torch.tensor([ep.turns for ep in episodes], device=device),
                          metrics={name: v.to(device) for name, v in env_metrics.items()},
                          cut_by=[ep.cut_by for ep in episodes])
        last_turns = [next((m["content"] for m in reversed(ep.messages) if m["role"] == "assistant"), "")
                      for ep in episodes]
        return Rollout.sampled(k, batch["input_ids"], batch["attention_mask"], batch["prompt"], columns, ids, policy,
                               torch.tensor([ep.truncated for ep in episodes], device=device), last_turns,
                               transcript_logps(episodes, ids.shape[1], device), record,
                               sample_columns={"transcript": transcripts})

    def _close(self, episodes: Sequence[LiveEpisode], where: Sequence[str]) -> None:
        """Close every episode that was not abandoned; a failing close is logged, never raised (it must not hide
        the episode's own error)."""
        todo = [i for i, ep in enumerate(episodes) if not ep.abandoned]
        for i, (status, value) in zip(todo, self.calls.run([episodes[i].env.close for i in todo])):
            if status != "ok":
                what = "did not return in time" if status == "timeout" else f"was not started: {value}" \
                    if status == "not started" else f"failed: {type(value).__name__}: {value}"
                logger.warning("environment %s.close %s on %s", type(episodes[i].env).__name__, what, where[i])


EPISODE_METRICS = ("replies_cut",)


class _Failures:
    """The failures of one rollout's episodes: each to the logger in full as it happens, one warning line at the
    end with their counts (``report``)."""

    def __init__(self, environment: str, episodes: int, on_error: tuple[str, float | None]) -> None:
        self.environment, self.episodes = environment.rsplit(".", 1)[-1], episodes
        self.score = "a missing reward" if on_error[1] is None else f"reward {on_error[1]}"
        self.counts: dict[str, int] = {}
        self.first: str | None = None

    def add(self, episode: LiveEpisode, row: int, error: EpisodeError) -> None:
        key = f"{error.call} {error.how}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.first = self.first or str(error)
        logger.warning("%s; the episode ends with %s (environment.on_error)", error, self.score)

    def report(self) -> None:
        if not self.counts:
            return
        total = sum(self.counts.values())
        kinds = ", ".join(f"{key}: {n}" for key, n in sorted(self.counts.items()))
        warnings.warn(f"{total} of {self.episodes} episodes failed ({kinds}); the first: {self.first}; each ended "
                      f"with {self.score} (environment.on_error); every failure is logged in full to the "
                      "'rloo_lightning' logger", EpisodeWarning, stacklevel=3)



def import_environment(path: str, option: str) -> type:
    """The :class:`Environment` subclass at import path ``path``; errors are :class:`EnvironmentConfigError`."""
    from rloo_lightning.runtime.importpath import ImportPathError, import_object

    try:
        cls = import_object(path, option)
    except ImportPathError as err:
        raise EnvironmentConfigError(str(err)) from err.__cause__
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentConfigError(f"{option} {path!r} is not a subclass of rloo_lightning.environments.Environment")
    return cls


class EpisodeWarning(RuntimeWarning):
    """Environments failed and ``environment.on_error`` scored their episodes (one warning per rollout)."""
