"""Fixed-lag rollouts (``rollout.lag`` K >= 1): step g trains on a rollout sampled from the weights of
step g - K, submitted to the engine K steps ahead and generated while the steps in between train. Everything of the
lag lives here: the positions and their seeds, the set-up and resume checks, the checkpoint entry and the metrics;
the module builds a :class:`RolloutPipeline` and calls :meth:`RolloutPipeline.rollout` from its one branch in
``training_step``.

The unit is the loader's position ``p`` (batches consumed on this rank, repeats of ``update.updates_per_rollout``
counted), so that accumulation and rollout reuse keep their meaning: the batch at position ``p`` is trained at
optimizer step ``p // A`` (``A`` = ``accumulate_grad_batches``), and a fresh rollout is due at every position
``p % U == 0``. At the first micro-batch of optimizer step ``g`` every fresh position of steps ``g .. g + K`` must be
in hand; those not yet submitted are submitted now, from the weights of step ``g``, in position order, each its own
engine batch, seeded as the step that trains on it would seed it (only the weights differ from a run with K = 0).
So after the first K steps, step ``g``'s rollout comes from step ``g - K`` exactly (the first K steps from the
initial weights: staleness ``min(g, K)``). Prompts ahead are read from the data module by position
(``train_batch(position)``), and the batch the loader hands to a step is checked against the one that was sampled.

At each step's end (before its update) the module calls :meth:`RolloutPipeline.step_end`. With an engine whose
sync waits for the requests on older weights (``GenerationEngine.keeps_versions`` False: merged weights), every
rollout still in flight is collected there, so between steps nothing is in flight: an engine that overlaps
(``GenerationEngine.overlaps``) generates step ``g + K``'s rollout during step ``g``'s training, one that does not
samples it at submission (exact, no overlap). An engine that keeps each version's weights while its requests run
(``keeps_versions``: a LoRA policy's adapters, one per sync) is not waited for: a rollout submitted at step ``g``
generates until step ``g + K`` takes it, across the K - 1 syncs between (the overlap a lag K >= 2 is for), and
at most K + 1 versions are in use. Whatever the engine, a checkpoint holds whole samples: writing one collects the
rollouts it holds first (:meth:`checkpoint_entry`; at a step's end, :meth:`step_end_entry` defers that to the
write, so that a step's end asks the engine nothing), and a resumed run continues with the same samples.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from rloo_lightning.rollout import Rollout

__all__ = ["RolloutPipeline", "Ahead", "DeferredEntry", "PipelineHost", "resumed_rollouts_ahead", "OPTION"]

OPTION = "rollout.lag"  # the option that sets the lag, as messages name it


@dataclass
class Ahead:
    """One rollout sampled ahead of the step that trains on it.

    Attributes:
        position: the loader position of the batch it is for.
        weights_step: the optimizer step whose weights sampled it (``global_step`` at submission).
        rows: ``[N]`` the prompts' ``row_index``; prompt_ids: ``[N, P]`` the prompts sent (the loader's batch is
            checked against both).
        pending: the sampler's handle while the engine samples; None once collected.
        rollout: the sampled (unscored) rollout once collected.
        seconds: the engine's time on it, when the engine says (``Submitted.seconds``).
    """

    position: int
    weights_step: int
    rows: Tensor
    prompt_ids: Tensor
    pending: Any = None
    rollout: Rollout | None = None
    seconds: float | None = None


class PipelineHost(Protocol):
    """What the pipeline needs of the module that trains on its rollouts (``RLOOModule``)."""

    def sampling_seed(self, stream: str, step: int) -> int:
        """The seed of the generation call of ``stream`` at optimizer step ``step``."""

    def submit_rollout(self, batch: dict, seed: int) -> Any:
        """Start sampling ``batch``'s rollout from the current weights: a handle for :meth:`collect_rollout`, or the
        :class:`Rollout` itself when the sampler cannot overlap (multi-turn episodes)."""

    def collect_rollout(self, handle: Any) -> tuple[Rollout, float | None]:
        """The rollout of a handle, and the engine's seconds on it when it says."""

    def batch_on_device(self, batch: dict) -> dict:
        """A batch drawn outside the loader, with its tensors on the module's device."""


class RolloutPipeline:
    """The rollouts ahead of the current step, by loader position (see the module docstring).

    Args:
        lag: K (>= 1).
        repeat: ``U``, ``update.updates_per_rollout`` (the loader yields each batch U times).
        host: the module that samples and trains (:class:`PipelineHost`).
        accumulate: ``A``, batches per optimizer step (read from the trainer by :meth:`start`).
    """

    def __init__(self, lag: int, repeat: int, host: PipelineHost | None = None, accumulate: int = 1) -> None:
        if lag < 1:
            raise ValueError(f"RolloutPipeline needs a lag >= 1, got {lag}")
        self.lag, self.repeat, self.host, self.accumulate = lag, repeat, host, accumulate
        self.datamodule = None  # the trainer's, from start(): train_batch(position)
        self.ahead: dict[int, Ahead] = {}
        self.weights_step_in_use: int | None = None  # the weights' step of the rollout being trained on
        self.wait_seconds = 0.0  # the trainer's wait for the engine since the last metrics
        self._round: tuple[float, list[Ahead]] | None = None  # (start, entries) of the last submission round
        self.engine_idle: float | None = None  # seconds the engine idled between the last two rounds, when known
        self._resumed: dict | None = None  # a checkpoint's rollouts ahead, until start()
        self.failed = False  # a collect raised: the engine is not asked again for a checkpoint
        self._started = False

    # -- fit set-up and start ----------------------------------------------------------------------
    def check_setup(self, trainer, correction, updates_per_rollout: int) -> None:
        """At fit's set-up, before any model is loaded: a data module that gives a later step's batch, an
        accumulation that stays fixed, and one line saying what K means for this run and which correction applies
        (``correction``: the resolved ``CorrectionArgs``)."""
        lag, datamodule = self.lag, trainer.datamodule
        if not callable(getattr(datamodule, "train_batch", None)):
            raise ValueError(f"{OPTION}={lag} samples the prompts of the next {lag} steps ahead: it needs a data "
                             "module with train_batch(position), the batch its train loader yields at that position "
                             f"(PromptDataModule has it; {type(datamodule).__name__} has not)")
        from lightning.pytorch.callbacks import GradientAccumulationScheduler
        scheduler = next((cb for cb in trainer.callbacks if isinstance(cb, GradientAccumulationScheduler)), None)
        if scheduler is not None:
            raise ValueError(f"{OPTION}={lag} submits the rollouts of the next {lag} optimizer steps by loader "
                             f"position, which needs a fixed accumulate_grad_batches; {type(scheduler).__name__} "
                             "changes it during the fit: set trainer.accumulate_grad_batches instead")
        how = "no correction (the stale samples train as if on-policy: biased)" if correction.level == "none" else (
            f"correction.level {correction.level} ({correction.mode}, cap {correction.cap})")
        message = (f"{OPTION}={lag}: step g trains on a rollout sampled from the weights of step g-{lag} "
                   f"(the first {lag} from the initial weights), generated while the steps between train; {how}"
                   + (f"; with update.updates_per_rollout={updates_per_rollout} the last update on a rollout is "
                      f"{lag + updates_per_rollout - 1} steps after its weights" if updates_per_rollout > 1 else ""))
        (rank_zero_warn if correction.level == "none" else rank_zero_info)(message)

    def start(self, trainer) -> None:
        """At fit start: nothing ahead but a resumed checkpoint's rollouts; the trainer's accumulation and data."""
        self.accumulate, self.datamodule = trainer.accumulate_grad_batches, trainer.datamodule
        self.reset()
        self._started = True
        if self._resumed is not None:
            self.load_state_dict(self._resumed)

    def reset(self) -> None:
        """Nothing ahead, nothing in use (the rollouts in flight are dropped, not collected)."""
        self.ahead, self.weights_step_in_use, self._round, self.engine_idle = {}, None, None, None
        self.wait_seconds, self.failed = 0.0, False

    def resume(self, state: dict | None) -> None:
        """A resumed checkpoint's rollouts ahead (:func:`resumed_rollouts_ahead`): loaded at :meth:`start`, or now
        for a strategy that restores the checkpoint after fit start."""
        self._resumed = state
        if state is not None and self._started:
            self.load_state_dict(state)

    # -- the step --------------------------------------------------------------------------------
    def rollout(self, batch: dict, batch_idx: int, global_step: int, take: bool = True) -> Rollout | None:
        """Step 1 under a lag, at training batch ``batch_idx`` of optimizer step ``global_step``: at the step's first
        micro-batch, submit the rollouts due (those of step ``global_step + K``) from the weights as they are; then
        (``take``) the rollout of this batch, sampled K optimizer steps ago. A step that reuses its rollout
        (``take`` False) submits all the same, so that the lag stays K."""
        position = global_step * self.accumulate + batch_idx % self.accumulate
        self.submit_due(position, global_step)
        return self.take(position, batch) if take else None

    def due(self, step: int) -> list[int]:
        """The fresh positions that must be in hand at the first micro-batch of optimizer step ``step``."""
        a = self.accumulate
        return [p for p in range(step * a, (step + self.lag + 1) * a) if p % self.repeat == 0]

    def submit_due(self, position: int, step: int) -> None:
        """At an optimizer step's first micro-batch (``position``, at step ``step``): submit what is due and not yet
        in hand, from the weights as they are."""
        if position % self.accumulate == 0:
            missing = [p for p in self.due(step) if p not in self.ahead]
            if missing:
                self._start_round(step, missing)

    def take(self, position: int, batch: dict) -> Rollout:
        """The rollout of the batch at ``position``, checked against the loader's ``batch``."""
        entry = self.ahead.pop(position, None)
        if entry is None:
            raise RuntimeError(f"{OPTION}: no rollout was sampled for the batch at position {position}; "
                               f"positions in hand: {sorted(self.ahead)}")
        self._finish(entry)
        self._check_batch(entry, batch)
        self.weights_step_in_use = entry.weights_step
        return entry.rollout

    def _submit(self, position: int) -> tuple[dict, Any]:
        """The batch at loader ``position`` and its sample started from the current weights, seeded as the step that
        trains on it (``position // A``) would seed it."""
        batch = self.host.batch_on_device(self.datamodule.train_batch(position))
        return batch, self.host.submit_rollout(batch, self.host.sampling_seed("train", position // self.accumulate))

    def _start_round(self, step: int, positions: list[int]) -> None:
        start = time.perf_counter()
        if self._round is not None:  # the engine's idle time between the two rounds: the interval less its work
            previous, entries = self._round
            busy = [e.seconds for e in entries]
            self.engine_idle = None if None in busy else max(0.0, start - previous - sum(busy))
        entries = []
        for p in positions:
            batch, started = self._submit(p)
            entry = Ahead(position=p, weights_step=step, rows=_rows(batch),
                          prompt_ids=batch["input_ids"].detach().cpu())
            if isinstance(started, Rollout):
                entry.rollout = started
                entry.seconds = time.perf_counter() - start if len(positions) == 1 else None
            else:
                entry.pending = started
            self.ahead[p] = entry
            entries.append(entry)
        self._round = (start, entries)

    def _finish(self, entry: Ahead) -> None:
        if entry.pending is None:
            return
        start = time.perf_counter()
        try:
            entry.rollout, entry.seconds = self.host.collect_rollout(entry.pending)
        except Exception:
            self.failed = True  # the engine failed: a checkpoint written now asks it nothing more (state_dict)
            raise
        entry.pending = None
        self.wait_seconds += time.perf_counter() - start

    def step_end(self, keeps_versions: bool) -> None:
        """At the end of each optimizer step, before its update (the module's ``on_before_optimizer_step``): collect
        every rollout still in flight unless the engine keeps each version's weights while its requests run
        (``keeps_versions``; see the module docstring)."""
        if not keeps_versions:
            self.drain()

    def drain(self) -> None:
        """Collect every rollout still in flight (kept until taken)."""
        for entry in sorted(self.ahead.values(), key=lambda e: e.position):
            self._finish(entry)

    @staticmethod
    def _check_batch(entry: Ahead, batch: dict) -> None:
        """The loader's batch must be the one sampled ahead (a data module whose ``train_batch`` does not follow
        its loader would otherwise train rollouts on other prompts' rewards)."""
        rows, ids = _rows(batch), batch["input_ids"].detach().cpu()
        if not (torch.equal(rows, entry.rows) and ids.shape == entry.prompt_ids.shape
                and torch.equal(ids, entry.prompt_ids)):
            raise RuntimeError(
                f"{OPTION}: the loader's batch at position {entry.position} (rows {rows.tolist()}) is not the one "
                f"sampled for it at optimizer step {entry.weights_step} (rows {entry.rows.tolist()}): the data "
                "module's train_batch(position) must return what its train loader yields at that position")

    # -- metrics -----------------------------------------------------------------------------------
    def metrics(self, global_step: int) -> dict[str, float]:
        """``train/staleness`` (optimizer steps between the rollout's weights and this update), the trainer's wait
        for the engine since the last call, the engine's idle time between its last two rounds (when the engine
        reports its own time) and the rollouts in hand ahead of this step."""
        values = {"train/staleness": float(global_step - (self.weights_step_in_use or 0)),
                  "train/rollout_wait_s": self.wait_seconds, "train/rollout_queue_depth": float(len(self.ahead))}
        if self.engine_idle is not None:
            values["train/engine_idle_s"] = self.engine_idle
        self.wait_seconds = 0.0
        return values

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint_entry(self, every_rank: Callable[[Any], list]) -> dict:
        """The checkpoint's ``rloo_pipeline``: the lag and each rank's rollouts ahead (its own prompts), by global
        rank (``every_rank``: a gather, a collective every rank calls at the same point). The rollouts still in
        flight are collected first: a checkpoint holds whole samples."""
        return self.collected_entry(list(self.ahead.values()), self.weights_step_in_use, every_rank)

    def step_end_entry(self, every_rank: Callable[[Any], list], keeps_versions: bool) -> Any:
        """The checkpoint entry as a save at this step's end would write it, kept for a stop inside the next step
        (``FinalCheckpoint``). After :meth:`step_end` collected everything (``keeps_versions`` False), the entry
        itself; otherwise a :class:`DeferredEntry` of the rollouts ahead now, collected and gathered when that
        checkpoint is written (the same decision on every rank: ``keeps_versions`` is the engine's)."""
        if not keeps_versions:
            return self.checkpoint_entry(every_rank)
        return DeferredEntry(self, list(self.ahead.values()), self.weights_step_in_use, every_rank)

    def collected_entry(self, entries: list[Ahead], weights_step_in_use: int | None,
                        every_rank: Callable[[Any], list]) -> dict:
        """The entry of ``entries``, each collected first. After the engine failed nothing more is asked of it: the
        finished rollouts only (a resumed run submits the missing positions again, from its weights)."""
        for entry in sorted(entries, key=lambda e: e.position):
            if not self.failed:
                self._finish(entry)
        state = {"weights_step_in_use": weights_step_in_use,
                 "ahead": [{"position": e.position, "weights_step": e.weights_step, "rows": e.rows,
                            "prompt_ids": e.prompt_ids, "fields": dataclasses.asdict(e.rollout)}
                           for e in entries if e.rollout is not None]}
        return {"lag": self.lag, "ranks": every_rank(state)}

    def load_state_dict(self, state: dict) -> None:
        # "version": the key of checkpoints written before the field was named weights_step
        self.ahead = {e["position"]: Ahead(position=e["position"], weights_step=e.get("weights_step", e.get("version")),
                                           rows=e["rows"], prompt_ids=e["prompt_ids"],
                                           rollout=Rollout.from_state(e["fields"]))
                      for e in state["ahead"]}
        self.weights_step_in_use = state.get("weights_step_in_use", state.get("version_in_use"))
        self._round = None


class DeferredEntry:
    """A step's end's ``rloo_pipeline`` entry whose rollouts may still be in flight: :meth:`resolve` collects them
    and gathers every rank's, when a checkpoint of that step's end is written (every rank calls it then). A copy is
    the same entry (the rollouts are not copied: they are the pipeline's own, filled in as they finish)."""

    def __init__(self, pipeline: RolloutPipeline, entries: list[Ahead], weights_step_in_use: int | None,
                 every_rank: Callable[[Any], list]) -> None:
        self.pipeline, self.entries, self.weights_step_in_use, self.every_rank = (pipeline, entries,
                                                                                  weights_step_in_use, every_rank)

    def __deepcopy__(self, memo: dict) -> DeferredEntry:
        return self

    def resolve(self) -> dict:
        return self.pipeline.collected_entry(self.entries, self.weights_step_in_use, self.every_rank)


def resumed_rollouts_ahead(checkpoint: dict, lag: int, world_size: int, rank: int) -> dict | None:
    """This rank's rollouts ahead from a checkpoint that a fit resumes, for the same lag ``lag`` (0: none); another
    lag is refused (the next steps would sample from other weights than the interrupted run's), and so is another
    number of ranks (each rank's rollouts ahead were sampled from its shard of the data)."""
    stored = checkpoint.get("rloo_pipeline")
    saved_lag = stored["lag"] if stored is not None else 0
    if saved_lag != lag and checkpoint.get("global_step", 0) > 0:
        raise ValueError(f"{OPTION}={lag}, but this checkpoint was trained with {saved_lag}: a resume keeps the lag "
                         "(the next steps would otherwise sample from other weights than the interrupted run's). "
                         f"Resume with --model.{OPTION} {saved_lag}, or export the weights and start a new fit "
                         "from them")
    if stored is None:
        return None
    if len(stored["ranks"]) != world_size:
        raise ValueError(f"{OPTION}={lag}: this checkpoint holds the rollouts ahead of {len(stored['ranks'])} ranks, "
                         f"sampled from their shards of the data; it resumes on {len(stored['ranks'])} ranks, "
                         f"not {world_size}")
    return stored["ranks"][rank]


def _rows(batch: dict) -> Tensor:
    """``[N]`` the batch's ``row_index`` (-1 each for a batch without one: its prompt ids are compared alone)."""
    rows = batch.get("row_index")
    return torch.full((batch["input_ids"].shape[0],), -1, dtype=torch.long) if rows is None else rows.detach().cpu()
