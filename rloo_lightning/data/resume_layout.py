"""What a fit's data position counts in (its layout: batch size, world size, repeats, accumulation), as a checkpoint
stores it, and the check that a resumed fit's layout still points where its run stopped."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_info

__all__ = ["LAYOUT_OPTIONS", "check_resumed_layout", "data_layout", "layout_change"]

# What a resumed run's data position means: it is a per-rank count of batches (optimizer steps x
# accumulate_grad_batches, each batch yielded repeat_batches times), so these decide which prompts it points at.
LAYOUT_OPTIONS = {"batch_size": "data.batch_size", "world_size": "the world size (trainer.devices x trainer.num_nodes)",
                  "repeat_batches": "model.update.updates_per_rollout", "accumulate_grad_batches":
                  "trainer.accumulate_grad_batches"}


def data_layout(batch_size: int, world_size: int, repeat_batches: int, accumulate_grad_batches: int) -> dict:
    """The options that give a data position its meaning (see :func:`layout_change`), as a checkpoint stores them."""
    return {"batch_size": int(batch_size), "world_size": int(world_size), "repeat_batches": int(repeat_batches),
            "accumulate_grad_batches": int(accumulate_grad_batches)}


def layout_change(saved: dict, now: dict, where: str) -> str | None:
    """Why a data position saved under the layout ``saved`` would not continue, under ``now``, where the saved run
    stopped (one line naming each changed option, ``where`` is the checkpoint); None when it does.

    The position is a count of per-rank batches. It points at the same prompts exactly when the global batch
    (``batch_size x world_size``), ``repeat_batches`` and ``accumulate_grad_batches`` are unchanged: global batch
    ``j`` of an epoch is then positions ``[j*G, (j+1)*G)`` of the same permutation (seed + epoch) whichever the
    split over ranks, and an epoch has ``N // G`` batches either way. Any other change is refused rather than
    converted: no count of batches of the new size need end where the old run stopped, and the trainer's
    restored step, which the position follows, would still be counted in the old batches. A ``saved`` without
    these keys (a checkpoint written before they were stored) is not checked.
    """
    if any(key not in saved for key in LAYOUT_OPTIONS):
        return None
    old, new = ({key: int(layout[key]) for key in LAYOUT_OPTIONS} for layout in (saved, now))
    global_old, global_new = old["batch_size"] * old["world_size"], new["batch_size"] * new["world_size"]
    changed = [key for key in ("repeat_batches", "accumulate_grad_batches") if old[key] != new[key]]
    if global_old != global_new:
        changed = [key for key in ("batch_size", "world_size") if old[key] != new[key]] + changed
    if not changed:
        return None
    what = "; ".join(f"{LAYOUT_OPTIONS[key]} was {old[key]} in {where}, is {new[key]} now" for key in changed)
    fixes = [f"{LAYOUT_OPTIONS[key]} {old[key]}" for key in changed if key not in ("batch_size", "world_size")]
    if global_old != global_new:  # the global batch: keep this run's ranks where they divide it
        fixes.insert(0, f"data.batch_size {global_old // new['world_size']}" if global_old % new["world_size"] == 0
                     else f"data.batch_size {old['batch_size']} on {_ranks(old['world_size'])}")
    extras = (f", each used for {old['repeat_batches']} updates" if old["repeat_batches"] > 1 else "") + \
        (f", {old['accumulate_grad_batches']} an optimizer step" if old["accumulate_grad_batches"] > 1 else "")
    return (f"{what}: the data position it holds counts batches of {old['batch_size']} prompts on each of "
            f"{_ranks(old['world_size'])} ({global_old} a step{extras}), so this "
            f"run would not continue from the prompt where that one stopped; resume with {' and '.join(fixes)}, or "
            "start a new run from its weights (rloo-lightning export, then --model.model_name_or_path)")


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def check_resumed_layout(saved: dict, now: dict, where: str) -> None:
    """Refuse a resumed fit whose data position would point elsewhere than where its run stopped (``ValueError``,
    :func:`layout_change`'s line; ``where`` is the checkpoint); one line when the batch is split over another number
    of ranks, which continues exactly."""
    changed = layout_change(saved, now, where)
    if changed is not None:
        raise ValueError(changed)
    before = (saved.get("batch_size"), saved.get("world_size"))
    if None not in before and before != (now["batch_size"], now["world_size"]):
        rank_zero_info(f"PromptDataModule: resumed with data.batch_size {now['batch_size']} on {now['world_size']} "
                       f"ranks, where the checkpoint's run had {before[0]} on {before[1]}: the same "
                       f"{now['batch_size'] * now['world_size']} prompts a step, so it continues from the prompt "
                       "where that run stopped")
