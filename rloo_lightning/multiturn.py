"""Moved to :mod:`rloo_lightning.environments`: the turn markers to ``turns``, the guarded calls to ``calls``, the
episode loop to ``episodes`` (``Episode`` is now ``LiveEpisode``) and the sampler to ``sampler``; this path will be
removed."""
from rloo_lightning._moved import moved

_ENV = "rloo_lightning.environments"
_MOVED = {
    "turns": ("TurnFormat",),
    "calls": ("EnvCalls", "EpisodeError", "call_error"),
    "sampler": ("EpisodeSampler", "EpisodeWarning", "EPISODE_METRICS", "import_environment"),
    "base": ("EnvironmentConfigError", "EnvStep", "Environment", "Message", "PolicyTurn"),
}

__getattr__ = moved(__name__, f"{_ENV}.episodes",
                    {"Episode": f"{_ENV}.episodes:LiveEpisode",  # the live state, apart from the record Episodes
                     **{name: f"{_ENV}.{module}" for module, names in _MOVED.items() for name in names}})
