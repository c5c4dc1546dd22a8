"""Shared fixtures: everything offline, tiny models built in code into temp directories."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one worker per CPU (pyproject's addopts): one thread each, as the CLI subprocesses get (cli_harness),
    # so that two workers never oversubscribe the cores with spinning OpenMP threads
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Tiny task models are built once per test session into a private cache, shared by the xdist workers
    (their base folders have one parent): a model or prompt cache is written to a temporary folder and renamed,
    so a worker never reads another's half-written one, and a model one worker built is not built again."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "rloo_cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("rloo_cache")
    old = os.environ.get("RLOO_LIGHTNING_CACHE")
    os.environ["RLOO_LIGHTNING_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("RLOO_LIGHTNING_CACHE", None)
    else:
        os.environ["RLOO_LIGHTNING_CACHE"] = old


def _save_tiny(directory, pad_is_eos: bool, seed: int = 0):
    from rloo_lightning.models import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer("abcdefgh=", model_max_length=32)
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32, seed=seed)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Llama + char tokenizer (pad != eos), saved to disk and loaded by path."""
    return _save_tiny(tmp_path_factory.mktemp("tiny"), pad_is_eos=False)


@pytest.fixture(scope="session")
def tiny_model_dir_pad_eos(tmp_path_factory):
    """Same, with ``pad_token == eos_token`` (as SmolLM2 and many chat models)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_pad_eos"), pad_is_eos=True)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def builds(monkeypatch):
    """The prompt-cache entries built during the test (their folders), in order."""
    from rloo_lightning.data.cache import PromptCache

    built = []
    original = PromptCache.build

    def counting(self, *args, **kwargs):
        built.append(self.path)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PromptCache, "build", counting)
    return built
