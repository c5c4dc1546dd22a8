"""The package's old module paths and their new ones, for a class or import path that no longer resolves.

Configs and checkpoints name engines, environments, tools and reward functions by path
(``rloo_lightning.vllm_engine.VLLMEngine``). The old module paths are gone (the package was never released, so
nothing imports through them); a path that names one gets one line naming the new path, from
:func:`renamed_hint`, where it fails to import: :func:`rloo_lightning.runtime.importpath.import_object` and the
command's option errors (:mod:`rloo_lightning.cli_errors`). ``docs/layout.md`` lists the same table.
"""

from __future__ import annotations

__all__ = ["RENAMED", "RENAMED_OPTIONS", "renamed_path", "renamed_hint", "renamed_option"]

_PKG = "rloo_lightning"


def _split(old: str, rest: str, names: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """``old`` to ``rest`` (its remaining names), and each of ``names[new]`` to ``new``: a module split in several."""
    table = {f"{_PKG}.{old}": f"{_PKG}.{rest}"}
    for new, moved in names.items():
        table.update({f"{_PKG}.{old}.{name}": f"{_PKG}.{new}.{name}" for name in moved})
    return table


# old path -> new path: a module (its names keep theirs), or one name of a module that was split or renamed.
RENAMED: dict[str, str] = {
    **{f"{_PKG}.{old}": f"{_PKG}.{new}" for old, new in [
        ("advantages", "algo.advantages"), ("kl", "algo.kl"), ("losses", "algo.losses"),
        ("correction", "algo.correction"), ("rewards.shaping", "algo.shaping"),
        ("decode", "engines.decode"), ("vllm_engine", "engines.vllm"),
        ("policy", "models.policy"), ("tiny_models", "models.tiny"), ("sharding", "models.sharding"),
        ("stop", "runtime.sigterm"), ("console", "runtime.console"), ("threads", "runtime.threads"),
        ("timing", "runtime.timing"), ("importpath", "runtime.importpath"), ("rewards.parallel", "runtime.workers"),
        ("exactness", "verify.exactness"), ("exactness_multiturn", "verify.exactness_multiturn"),
    ]},
    **_split("checkpoint_io", "runtime.atomic_checkpoint", {"runtime.checkpoint_check": (
        "check_checkpoint_path", "checkpoint_file_problem", "local_checkpoint_path", "LIGHTNING_KEYS",
        "optimizer_state_ratio")}),
    **_split("logprobs", "algo.logprobs", {
        "forward": ("completion_logits", "can_share_prompt", "shared_prompt_logits", "worth_sharing",
                    "sequence_logprobs", "SHARE_MIN_WORK"),
        "engines.kv_cache": ("cache_keyword", "returned_cache", "prefill_groups")}),
    **_split("multiturn", "environments.episodes", {
        "environments.turns": ("TurnFormat",),
        "environments.calls": ("EnvCalls", "EpisodeError", "call_error"),
        "environments.sampler": ("EpisodeSampler", "EpisodeWarning", "EPISODE_METRICS", "import_environment"),
        "environments.base": ("EnvironmentConfigError", "EnvStep", "Environment", "Message", "PolicyTurn")}),
    f"{_PKG}.multiturn.Episode": f"{_PKG}.environments.episodes.LiveEpisode",  # apart from the record Episodes
}


def renamed_path(path: str) -> str | None:
    """The new path of ``path`` when it names an old module or something in one (its longest prefix in
    :data:`RENAMED`, the rest kept), else None."""
    if not isinstance(path, str):
        return None
    parts = path.strip().split(".")
    for cut in range(len(parts), 1, -1):
        new = RENAMED.get(".".join(parts[:cut]))
        if new is not None:
            return ".".join([new, *parts[cut:]])
    return None


def renamed_hint(path: str) -> str | None:
    """``"<path> was renamed <new path>: use the new path"`` for a path that names an old module, else None."""
    new = renamed_path(path)
    return None if new is None else f"{path.strip()} was renamed {new}: use the new path"


# old option -> new option (of the model's option groups): the old name answered with the new one.
RENAMED_OPTIONS: dict[str, str] = {
    "rollout.max_staleness": "rollout.lag",  # a fixed lag, not a maximum (docs/async.md)
}


def renamed_option(key: str) -> str | None:
    """The new name of an option that was renamed, as ``key`` is written (``rollout.max_staleness``,
    ``model.rollout.max_staleness`` or ``--model.rollout.max_staleness``), else None."""
    prefix = "--" if key.startswith("--") else ""
    rest = key[len(prefix):]
    scope = "model." if rest.startswith("model.") else ""
    new = RENAMED_OPTIONS.get(rest[len(scope):])
    return None if new is None else f"{prefix}{scope}{new}"

