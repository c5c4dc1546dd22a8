"""The reference policy pi_ref of the KL term: its log-probs, its optional sync toward the policy, its state.

The paper's reference is the initial policy (Ahmadian et al. 2024, Sec. 2.3). It has two forms here:

- a frozen **copy** of the initial policy, held outside the module's registered submodules (never trained,
  wrapped, sharded or checkpointed by Lightning), made before FSDP2 shards the policy, so it stays whole;
- under **LoRA** the policy itself with its adapter disabled (``peft``'s ``disable_adapter``): exactly the
  initial policy, since the adapter starts at 0, for no memory at all.

``kl.ref_sync_steps`` (TR-DPO, TRL ``sync_ref_model``) moves a copy toward the policy; the moved copy is then
part of the checkpoint (:meth:`ReferencePolicy.state_dict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from rloo_lightning.algo.kl import mix_into_reference

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    """pi_ref behind one small object: :meth:`logprobs`, :meth:`sync`, :meth:`state_dict`.

    Attributes:
        copy: the frozen copy, or None under LoRA (then the policy with its adapter off is the reference).
        sync_steps, sync_alpha: ``kl.ref_sync_steps`` and ``kl.ref_sync_alpha`` (0: the reference never moves).
    """

    def __init__(self, copy: torch.nn.Module | None, sync_steps: int = 0, sync_alpha: float = 0.6) -> None:
        self.copy = copy.eval().requires_grad_(False) if copy is not None else None
        self.sync_steps, self.sync_alpha = sync_steps, sync_alpha

    def model(self, policy: torch.nn.Module, device: torch.device | None = None) -> torch.nn.Module:
        """The module whose forward is pi_ref: the copy, on ``device`` (default: the policy's) and in the policy's
        dtype; under LoRA ``policy`` itself (in :meth:`forward_context`).

        The copy follows the policy: Lightning moves the policy (and casts it under ``bf16-true``) after
        ``configure_model`` and never sees the unregistered copy. Same dtype, so that KL = 0 at step 0.
        """
        if self.copy is None:
            return policy
        ref, pol = next(self.copy.parameters()), next(policy.parameters())
        device = device if device is not None else pol.device
        if ref.device != device or ref.dtype != pol.dtype:
            self.copy.to(device=device, dtype=pol.dtype)
        return self.copy

    def forward_context(self, policy: torch.nn.Module):
        """The context in which :meth:`model`'s forward is pi_ref: the adapter disabled under LoRA."""
        return policy.disable_adapter() if self.copy is None else contextlib.nullcontext()

    def logprobs(self, policy: torch.nn.Module, logprobs_of: Callable[[torch.nn.Module, slice], Tensor],
                 rows: list[slice], grad_free, device: torch.device | None = None) -> Tensor:
        """``[B, T]`` log-probs of a rollout's completions under pi_ref, one micro-batch (``rows``) at a time.

        ``logprobs_of(model, rows) -> [b, T]`` is the policy's own log-prob function (same temperature, same
        prompt sharing); ``grad_free`` the context it runs in (``inference_mode`` or ``no_grad``). The result is a
        normal tensor, never an inference tensor: the loss may save it for its backward (``kl.placement: loss``).
        """
        model = self.model(policy, device)
        with grad_free, self.forward_context(policy):
            logp = torch.cat([logprobs_of(model, r) for r in rows])
        return logp.clone() if logp.is_inference() else logp

    def sync(self, policy: torch.nn.Module, step: int, device: torch.device | None = None) -> bool:
        """``kl.ref_sync_steps``: at every multiple of it (after step 0), ``ref = alpha*policy + (1-alpha)*ref``.

        Called at the start of a step, that is after the previous optimizer step, so that a checkpoint of the
        previous step and a run resumed from it mix alike. A sharded (FSDP2) policy's parameters are gathered
        first: the copy is whole. Returns whether it mixed.
        """
        if not self.sync_steps or self.copy is None or step == 0 or step % self.sync_steps:
            return False
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in policy.parameters()]
        mix_into_reference(self.model(policy, device).parameters(), params, self.sync_alpha)
        return True

    def state_dict(self) -> dict | None:
        """The copy's weights when it moves (``kl.ref_sync_steps``); None when it is the initial policy (nothing to
        keep: a resumed run rebuilds it)."""
        return self.copy.state_dict() if self.sync_steps and self.copy is not None else None

    def load_state_dict(self, state: dict) -> None:
        if self.copy is not None:
            self.copy.load_state_dict(state)
