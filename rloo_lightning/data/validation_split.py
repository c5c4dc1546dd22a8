"""How validation prompts are held out of a training file: how many (a fraction, a count, the default's cap), the
count a resumed run keeps, how the split line says it, and the warning when too few are left to compare val/
metrics."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

__all__ = ["DEFAULT_VAL_CAP", "DEFAULT_VAL_SIZE", "SMALL_VALIDATION", "default_cap_applies", "held_out_count",
           "hold_out_rule", "hold_out_text", "report_split", "resumed_validation_rows"]

SMALL_VALIDATION = 8  # fewer validation prompts than this: a warning (val/reward is too noisy to compare)
DEFAULT_VAL_SIZE = 0.1
# Without val_size, 10 % of a file is held out, at most this many prompts: a validation runs every val_check_interval
# and before training, and 1,000 prompts already give val/reward a standard error under 0.016 (a reward in [0, 1]).
DEFAULT_VAL_CAP = 1000


def held_out_count(val_size: float, n: int, cap: int | None = None) -> int:
    """Validation rows held out of ``n``: a fraction (< 1) of them, rounded, or a count (>= 1); at most ``cap``."""
    count = int(round(val_size * n)) if val_size < 1 else int(val_size)
    return count if cap is None else min(count, cap)


def hold_out_rule(val_size: float | None, seed: int, kept_rows: int | None) -> tuple:
    """How the validation rows are held out of ``train_file``: ``(split, val_size, seed[, cap])``. A resumed run
    holds out the count it recorded (``kept_rows``, see :func:`resumed_validation_rows`): the same seed's shuffle, so
    the same rows. ``val_size`` None: the default fraction, capped."""
    if kept_rows is not None:
        return ("validation", kept_rows, seed)
    if val_size is None:
        return ("validation", DEFAULT_VAL_SIZE, seed, DEFAULT_VAL_CAP)
    return ("validation", val_size, seed)


def default_cap_applies(val_size: float | None, kept_rows: int | None, n: int) -> bool:
    """The default hold-out (no ``val_size``, not a resumed split) of ``n`` rows hits ``DEFAULT_VAL_CAP``."""
    return val_size is None and kept_rows is None and round(DEFAULT_VAL_SIZE * n) > DEFAULT_VAL_CAP


def hold_out_text(val_size: float | None, kept_rows: int | None, n: int) -> str:
    """How the hold-out of ``n`` rows was sized, as the split line says it."""
    if kept_rows is not None:
        return f"the {kept_rows} the resumed run started with"
    if val_size is None:
        return f"val_size={DEFAULT_VAL_SIZE}" + (f" capped at {DEFAULT_VAL_CAP}"
                                                 if default_cap_applies(val_size, kept_rows, n) else "")
    return f"val_size={val_size}"


def resumed_validation_rows(held: dict, source_rows: int, seed: int, train_file, n_val: int) -> int | None:
    """The validation count a resumed run keeps, from the checkpoint's ``held`` (its ``held_out`` state): its count
    when it differs from ``n_val`` (what the current options hold out) and was drawn from ``source_rows`` rows with
    ``seed`` (the same seed's shuffle of the same rows: the first ``count`` of it), else None; a warning when the
    split cannot be the same."""
    count, n = int(held["validation_rows"]), int(held["source_rows"])
    if n != source_rows or held["seed"] != seed:
        rank_zero_warn(f"PromptDataModule: the checkpoint's run held its validation prompts out of {n} rows with "
                       f"seed {held['seed']}; {train_file} now has {source_rows} rows (seed {seed}): the split cannot "
                       "be the same, and some of its validation prompts may now be trained on")
        return None
    if count == n_val:
        return None
    rank_zero_info(f"PromptDataModule: resumed: keeping the run's {count} validation prompts (the current options "
                   f"would hold out {n_val})")
    return count


def report_split(hp, n_train: int, n_val: int, origin: tuple[str, str]) -> None:
    """One info line with both split sizes and their ``origin`` (training, validation); a warning if validation is
    very small. ``hp``: the data module's hyperparameters."""
    train_from, val_from = origin
    rank_zero_info(f"PromptDataModule: {n_train} training prompts {train_from}, "
                   f"{n_val} validation prompts {val_from}")
    deliberate_empty = n_val == 0 and hp.val_file is None and hp.task is None and hp.val_size == 0
    if n_val < SMALL_VALIDATION and not deliberate_empty:
        if hp.task is not None:
            knob = "raise num_val_rows"
        elif hp.val_file is not None:
            knob = f"add prompts to val_file {hp.val_file}"
        else:
            val_size = DEFAULT_VAL_SIZE if hp.val_size is None else hp.val_size
            knob = f"val_size={val_size} gives {n_val}; raise val_size (a fraction < 1 or a count >= 1)"
        rank_zero_warn(f"PromptDataModule: the validation split has only {n_val} prompts (fewer than "
                       f"{SMALL_VALIDATION}): val/ metrics will be too noisy to compare; {knob}")
