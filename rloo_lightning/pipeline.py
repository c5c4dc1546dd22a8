"""Fixed-lag rollouts (``rollout.max_staleness`` K >= 1): step g trains on a rollout sampled from the weights of
step g - K, submitted to the engine K steps ahead and generated while the steps in between train.

The unit is the loader's position ``p`` (batches consumed on this rank, repeats of ``update.updates_per_rollout``
counted), so that accumulation and rollout reuse keep their meaning: the batch at position ``p`` is trained at
optimizer step ``p // A`` (``A`` = ``accumulate_grad_batches``), and a fresh rollout is due at every position
``p % U == 0``. At the first micro-batch of optimizer step ``v`` every fresh position of steps ``v .. v + K`` must be
in hand; those not yet submitted are submitted now, from the weights of step ``v``, in position order, each its own
engine batch. So after the first K steps, step ``v``'s rollout comes from step ``v - K`` exactly (the first K steps
from the initial weights: staleness ``min(v, K)``). Prompts ahead are read from the data module by position
(``train_batch(position)``), and the batch the loader hands to a step is checked against the one that was sampled.

Between steps nothing is in flight: building the checkpoint entries (at every step's end) collects what is pending,
so a checkpoint holds the K finished rollouts ahead of it and a resumed run continues with the same samples. An engine
that overlaps (``GenerationEngine.overlaps``) thus generates step ``v + K``'s rollout during step ``v``'s training;
one that does not samples it at submission (exact, no overlap).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from rloo_lightning.rollout import Rollout

__all__ = ["RolloutPipeline", "Ahead"]


@dataclass
class Ahead:
    """One rollout sampled ahead of the step that trains on it.

    Attributes:
        position: the loader position of the batch it is for.
        version: the optimizer step whose weights sampled it (``global_step`` at submission).
        rows: ``[N]`` the prompts' ``row_index``; prompt_ids: ``[N, P]`` the prompts sent (the loader's batch is
            checked against both).
        pending: the sampler's handle while the engine samples; None once collected.
        rollout: the sampled (unscored) rollout once collected.
        seconds: the engine's time on it, when the engine says (``Submitted.seconds``).
    """

    position: int
    version: int
    rows: Tensor
    prompt_ids: Tensor
    pending: Any = None
    rollout: Rollout | None = None
    seconds: float | None = None


class RolloutPipeline:
    """The rollouts ahead of the current step, by position (see the module docstring).

    Args:
        lag: K, ``rollout.max_staleness`` (>= 1).
        accumulate: ``A``, batches per optimizer step.
        repeat: ``U``, ``update.updates_per_rollout`` (the loader yields each batch U times).
        submit: ``submit(position, version) -> (batch, handle or Rollout)``: the batch at ``position`` (from the data
            module) and its sample started from the current weights: a handle for ``collect``, or the rollout
            itself when the sampler cannot overlap (multi-turn episodes).
        collect: ``collect(handle) -> (Rollout, engine seconds or None)``.
    """

    def __init__(self, lag: int, accumulate: int, repeat: int,
                 submit: Callable[[int, int], tuple[dict, Any]],
                 collect: Callable[[Any], tuple[Rollout, float | None]]) -> None:
        if lag < 1:
            raise ValueError(f"RolloutPipeline needs a lag >= 1, got {lag}")
        self.lag, self.accumulate, self.repeat = lag, accumulate, repeat
        self._submit, self._collect = submit, collect
        self.ahead: dict[int, Ahead] = {}
        self.version_in_use: int | None = None  # the weights' step of the rollout being trained on (reuse included)
        self.wait_seconds = 0.0  # the trainer's wait for the engine since the last metrics
        self._round: tuple[float, list[Ahead]] | None = None  # (start, entries) of the last submission round
        self.engine_idle: float | None = None  # seconds the engine idled between the last two rounds, when known

    # -- the step --------------------------------------------------------------------------------
    def due(self, version: int) -> list[int]:
        """The fresh positions that must be in hand at the first micro-batch of optimizer step ``version``."""
        a = self.accumulate
        return [p for p in range(version * a, (version + self.lag + 1) * a) if p % self.repeat == 0]

    def submit_due(self, position: int, version: int) -> None:
        """At an optimizer step's first micro-batch (``position``, at step ``version``): submit what is due and not yet
        in hand, from the weights as they are."""
        if position % self.accumulate == 0:
            missing = [p for p in self.due(version) if p not in self.ahead]
            if missing:
                self._start_round(version, missing)

    def take(self, position: int, batch: dict) -> Rollout:
        """The rollout of the batch at ``position``, checked against the loader's ``batch``."""
        entry = self.ahead.pop(position, None)
        if entry is None:
            raise RuntimeError(f"rollout.max_staleness: no rollout was sampled for the batch at position {position}; "
                               f"positions in hand: {sorted(self.ahead)}")
        self._finish(entry)
        self._check_batch(entry, batch)
        self.version_in_use = entry.version
        return entry.rollout

    def _start_round(self, version: int, positions: list[int]) -> None:
        start = time.perf_counter()
        if self._round is not None:  # the engine's idle time between the two rounds: the interval less its work
            previous, entries = self._round
            busy = [e.seconds for e in entries]
            self.engine_idle = None if None in busy else max(0.0, start - previous - sum(busy))
        entries = []
        for p in positions:
            batch, started = self._submit(p, version)
            entry = Ahead(position=p, version=version, rows=_rows(batch), prompt_ids=batch["input_ids"].detach().cpu())
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
        entry.rollout, entry.seconds = self._collect(entry.pending)
        entry.pending = None
        self.wait_seconds += time.perf_counter() - start

    def drain(self) -> None:
        """Collect every rollout still in flight (before a checkpoint is built)."""
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
                f"rollout.max_staleness: the loader's batch at position {entry.position} (rows {rows.tolist()}) is not "
                f"the one sampled for it at optimizer step {entry.version} (rows {entry.rows.tolist()}): the data "
                "module's train_batch(position) must return what its train loader yields at that position")

    # -- metrics -----------------------------------------------------------------------------------
    def metrics(self, global_step: int) -> dict[str, float]:
        """``train/staleness`` (optimizer steps between the rollout's weights and this update), the trainer's wait
        for the engine since the last call, the engine's idle time between its last two rounds (when the engine
        reports its own time) and the rollouts in hand ahead of this step."""
        values = {"train/staleness": float(global_step - (self.version_in_use or 0)),
                  "train/rollout_wait_s": self.wait_seconds, "train/rollout_queue_depth": float(len(self.ahead))}
        if self.engine_idle is not None:
            values["train/engine_idle_s"] = self.engine_idle
        self.wait_seconds = 0.0
        return values

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The finished rollouts ahead (collected first: a checkpoint holds whole samples)."""
        self.drain()
        return {"version_in_use": self.version_in_use,
                "ahead": [{"position": e.position, "version": e.version, "rows": e.rows, "prompt_ids": e.prompt_ids,
                           "fields": dataclasses.asdict(e.rollout)} for e in self.ahead.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.ahead = {e["position"]: Ahead(position=e["position"], version=e["version"], rows=e["rows"],
                                           prompt_ids=e["prompt_ids"], rollout=Rollout.from_state(e["fields"]))
                      for e in state["ahead"]}
        self.version_in_use = state.get("version_in_use")
        self._round = None


def _rows(batch: dict) -> Tensor:
    """``[N]`` the batch's ``row_index`` (-1 each for a batch without one: its prompt ids are compared alone)."""
    rows = batch.get("row_index")
    return torch.full((batch["input_ids"].shape[0],), -1, dtype=torch.long) if rows is None else rows.detach().cpu()
