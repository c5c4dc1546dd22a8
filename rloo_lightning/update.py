"""Lightning mechanics of the update: the policy's forwards micro-batch by micro-batch, their gradients, the NaN/inf
guard, rollout reuse.

Each piece is a small object the module holds and calls from one place in its hooks, so that the
training step itself stays the algorithm.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from rloo_lightning.rollout import Rollout
from rloo_lightning.runtime import framework

__all__ = ["NonFiniteError", "NonFiniteGuard", "GradientStash", "PolicyUpdate", "RolloutReuse", "micro_batches",
           "warmup_constant_schedule",
           "loss_denominators"]


class NonFiniteError(FloatingPointError):
    """A NaN/inf loss or gradient, with the step and the rollout statistics that led to it."""


def micro_batches(num_sequences: int, size: int | None) -> list[slice]:
    """Row slices of a rollout for the forward/backward passes (``size`` rows each; None = one slice)."""
    size = size or num_sequences
    return [slice(s, min(s + size, num_sequences)) for s in range(0, num_sequences, size)]


class GradientStash:
    """Gradients of all micro-batches but the last, held until Lightning's backward of the last one.

    Not ``loss.backward()``: Lightning zeroes the gradients *after* ``training_step`` returns, and
    under DDP the first backward after the forward would all-reduce a partial gradient.
    ``autograd.grad`` fires neither DDP's hooks nor writes ``.grad``; :meth:`inject` (called from
    ``on_before_backward``) adds the sum into ``.grad`` just before the last micro-batch's backward,
    whose all-reduce then carries the whole rollout's gradient. FSDP2 modules get a real backward
    with gradient synchronisation off instead (their gradients accumulate unsharded until the last one).
    """

    def __init__(self) -> None:
        self.grads: list[Tensor | None] | None = None

    def backward_early(self, loss: Tensor, model: torch.nn.Module, scaler=None) -> None:
        if scaler is not None:  # fp16 AMP scales the loss Lightning backpropagates: scale ours alike
            loss = scaler.scale(loss)
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(False)
            try:
                loss.backward()
            finally:
                model.set_requires_gradient_sync(True)
            return
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        if self.grads is None:
            self.grads = list(grads)
        else:
            self.grads = [s if g is None else g if s is None else s.add_(g) for s, g in zip(self.grads, grads)]

    def inject(self, model: torch.nn.Module) -> None:
        if self.grads is None:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p, g in zip(params, self.grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.grads = None


class PolicyUpdate:
    """The policy's forwards on one rollout, micro-batch by micro-batch: the log-probs the step reads before its
    loss (:meth:`detached_logprobs`) and the loss with its entropy (:meth:`loss`).

    One micro-batch: its forward (with grad and entropy) runs once, for the log-probs, and is kept for the loss.
    Several: the log-probs are forwards without grad, one per micro-batch, only where they are needed; the loss
    runs each micro-batch's forward with grad, and differentiates every micro-batch but the last at once
    (``backward_early``: :class:`GradientStash`), so that one micro-batch's graph is alive at a time.

    Args:
        forward: ``forward(rows, with_entropy)``: ``(logp [b, T], entropy [b, T] or None)`` of ``rows`` under the
            policy, with grad where grad is on.
        rows: the micro-batches (:func:`micro_batches`).
        timer: the module's :class:`~rloo_lightning.runtime.timing.PhaseTimer`: ``update_forward`` (each forward
            and loss of :meth:`loss`) and ``update_backward`` (the early backwards).
    """

    def __init__(self, forward: Callable[[slice, bool], tuple[Tensor, Tensor | None]], rows: list[slice],
                 timer) -> None:
        self.forward, self.rows, self.timer = forward, rows, timer
        self._kept: tuple[Tensor, Tensor | None] | None = None  # one micro-batch: its forward, with grad

    def detached_logprobs(self, needed: bool) -> Tensor | None:
        """``[B, T]`` the policy's log-probs of the whole rollout, detached; None when not ``needed`` and the rollout
        has several micro-batches (one micro-batch runs its forward here whatever ``needed``: the loss uses it)."""
        if len(self.rows) == 1:
            self._kept = self.forward(self.rows[0], True)
            return self._kept[0].detach()
        if not needed:
            return None
        with torch.no_grad():
            return torch.cat([self.forward(r, False)[0] for r in self.rows])

    def loss(self, policy_loss, rollout: Rollout, advantages: Tensor, denominators: dict, beta: Tensor,
             backward_early: Callable[[Tensor], None]) -> tuple[Tensor, Tensor | None, dict]:
        """``(loss, entropy [B, T], clip statistics)``: the last micro-batch's loss for Lightning's backward plus
        the others' values (detached), so that the logged loss is the rollout's.

        Args:
            policy_loss: a :class:`~rloo_lightning.algo.losses.PolicyLoss`.
            advantages: ``[B]`` or ``[B, T]``, as the loss takes them.
            denominators: :func:`loss_denominators`, fixed over the whole rollout and every rank.
        """
        loss_mask = rollout.loss_mask
        clip_stats, entropies, earlier = {}, [], None
        for i, r in enumerate(self.rows):
            with self.timer("update_forward"):
                logp, entropy = self._kept if self._kept is not None else self.forward(r, True)
                loss, stats = policy_loss(
                    logp, loss_mask[r], advantages[r], denominators,
                    None if rollout.old_logp is None else rollout.old_logp[r],
                    None if rollout.ref_logp is None else rollout.ref_logp[r], beta)
            for name, (total, count) in stats.items():
                s, n = clip_stats.get(name, (0.0, 0.0))
                clip_stats[name] = (s + total, n + count)
            entropies.append(entropy)
            if i < len(self.rows) - 1:
                with self.timer("update_backward"):
                    backward_early(loss)
                earlier = loss.detach() if earlier is None else earlier + loss.detach()
        entropy = torch.cat(entropies) if entropies[0] is not None else None
        return (loss if earlier is None else loss + earlier), entropy, clip_stats


class RolloutReuse:
    """``updates_per_rollout > 1``: the stored rollout and how many updates it has had.

    The data module repeats each batch ``updates_per_rollout`` times (the CLI links the option);
    the repeated batches are answered with the stored rollout. A checkpoint taken between two
    updates on one rollout holds it, so the resumed run goes on with it.
    """

    def __init__(self, updates_per_rollout: int) -> None:
        self.updates_per_rollout = updates_per_rollout
        self.stored: Rollout | None = None
        self.updates = 0
        self._warned = False

    def take(self, batch: dict) -> Rollout | None:
        """The stored rollout if it has updates left, else None (a fresh rollout is due)."""
        if self.stored is None or self.updates >= self.updates_per_rollout:
            self.stored, self.updates = None, 0
            return None
        if list(batch["prompt"]) != self.stored.prompts[:: self.stored.k] and not self._warned:
            self._warned = True
            rank_zero_warn("update.updates_per_rollout > 1: this batch's prompts are not the stored rollout's and "
                           "are skipped; PromptDataModule repeats each batch updates_per_rollout times (the CLI "
                           "links it)")
        return self.stored

    def record(self, rollout: Rollout) -> None:
        if self.updates_per_rollout > 1:
            self.stored, self.updates = rollout, self.updates + 1

    def state_dict(self) -> dict | None:
        if self.stored is None or self.updates >= self.updates_per_rollout:
            return None
        return {"updates": self.updates, "fields": dataclasses.asdict(self.stored)}

    def load_state_dict(self, state: dict) -> None:
        self.stored, self.updates = Rollout.from_state(state["fields"]), state["updates"]

    def load_rank(self, entry: dict, rank: int, world_size: int) -> None:
        """This rank's stored rollout from a checkpoint's ``rloo_rollout`` (every rank's, by global rank; earlier
        checkpoints: rank 0's alone)."""
        ranks = entry.get("ranks", [entry])
        self.load_state_dict(ranks[rank] if len(ranks) == world_size else ranks[0])



def warmup_constant_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int):
    """Linear warm-up from ~0 to the base rate over ``warmup_steps``, then constant (the paper's schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))


def loss_denominators(rollout: Rollout, reduce, world_size: int, norm_constant: float) -> dict:
    """The divisors of :func:`~rloo_lightning.algo.losses.aggregate_token_loss`, global over ranks, fixed before
    any micro-batch so that the micro-batch losses add up to the whole rollout's.

    DDP averages gradients over ranks, so each rank divides its sum by (global count / world size). If
    nothing is kept the loss is an exact zero that still touches the graph (no DDP hang). One all-reduce.
    """
    kept = torch.stack([rollout.keep.sum().float(), rollout.loss_mask.sum()])
    sequences, tokens = reduce(kept, "sum") / world_size
    return {"num_sequences": torch.where(sequences > 0, sequences, torch.ones_like(sequences)),
            "num_tokens": tokens.clamp(min=1e-8), "norm_constant": norm_constant}


class NonFiniteGuard:
    """``update.on_nonfinite``: a NaN/inf loss or gradient stops the run (``stop``) or drops the update (``skip``).

    ``finite`` is decided on every rank together (one all-reduce), so that all ranks skip alike.
    """

    def __init__(self, mode: str) -> None:
        self.mode, self.skipped_steps = mode, 0

    @staticmethod
    def finite(reduce, *tensors: Tensor) -> bool:
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2: this rank's shard,
        nonempty = [t.detach() for t in local if t.numel()]  # which may be empty
        if nonempty:
            # Each tensor's max-abs norm, one fused op for all of them (not two ops a tensor): it is inf or NaN
            # iff some element is, and a finite tensor never overflows it (a sum or a 2-norm could).
            norms = framework.foreach_norm(nonempty, ord=float("inf"))
            ok = torch.stack([n.float() for n in norms]).isfinite().all().float()
        else:
            ok = torch.ones((), device=tensors[0].device)
        return bool(reduce(ok, "min") > 0)

    def handle(self, what: str, step: int, stats: dict[str, float]) -> None:
        """Raise (``stop``) or count and warn (``skip``)."""
        message = f"non-finite {what} at step {step}; rollout statistics: " + ", ".join(
            f"{k}={v:.4g}" for k, v in stats.items())
        if self.mode == "stop":
            raise NonFiniteError(message + " (update.on_nonfinite=stop: no update applied, no checkpoint written)")
        self.skipped_steps += 1
        rank_zero_warn(message + " (update.on_nonfinite=skip: update dropped)")
