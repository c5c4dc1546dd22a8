"""Shared fixtures: everything offline, tiny models built in code into temp directories."""

from __future__ import annotations

import collections
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


# xdist (pyproject's addopts: `-n auto --dist loadfile --no-loadscope-reorder`) gives each worker whole files, in
# the order collected, the next one as soon as the worker has 2 tests left. Left to its own order (the files with
# the most tests first), the few-test files that run longest (a module fixture of distributed runs, a 135M model)
# would come last, one worker running alone at the end while the other has nothing left. So under xdist the files
# are collected most costly first (longest processing time first), by the rough costs below: seconds of one worker
# on 2 idle cores (a run's `--durations` summed per file, rounded). A file not listed counts as light and comes
# after the listed ones, the files with the most tests first. Rough is enough: the order matters, not the figures.
# `-n 0` keeps the files in their own order.
FILE_COST_S = {
    "test_verify_exactness.py": 105,
    "test_studies.py": 85,
    "test_runtime_sigterm_ranks.py": 80,
    "test_engines_vllm_server_liveness.py": 75,
    "test_runtime_sigint.py": 60,
    "test_resume.py": 50,
    "test_runtime_sigterm.py": 50,
    "test_pipeline_runs.py": 40,
    "test_verify_exactness_stale.py": 30,
    "test_callbacks_final_checkpoint.py": 30,
    "test_models_gguf.py": 30,
    "test_runtime_console_runs.py": 25,
    "test_models_sharding_runs.py": 25,
    "test_cli_multiturn.py": 25,
    "test_cli_after_fit.py": 20,
    "test_module_variants.py": 20,
    "test_data_resume_layout.py": 20,
    "test_configs.py": 20,
    "test_readme_figures.py": 20,
    "test_export_predict.py": 20,
    "test_runtime_atomic_checkpoint.py": 20,
    "test_data_cache_integrity.py": 20,
    "test_pipeline.py": 20,
    "test_environments_hostile.py": 20,
    "test_verify_exactness_long.py": 20,
    "test_user_paths.py": 15,
    "test_serve.py": 15,
    "test_rollout_stops.py": 15,
    "test_rewards_workers.py": 15,
    "test_engines_vllm_server_lora.py": 15,
}


def pytest_collection_modifyitems(config, items):
    """Under xdist: the most costly files first (see FILE_COST_S); each file's tests keep their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    tests = collections.Counter(item.path.name for item in items)
    items.sort(key=lambda item: (-FILE_COST_S.get(item.path.name, 0), -tests[item.path.name]))  # a stable sort


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


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny-tensor tests: as fast, and it does not fight other jobs for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory):
    """The reverse task's tiny model with 2 heads of 32 (vLLM's CPU attention has no head size 16) and 512 positions
    (long prompts), for the vLLM server tests."""
    from rloo_lightning.tasks import reverse

    directory = tmp_path_factory.mktemp("server_model")
    reverse.build_tiny_model(directory, num_heads=2, max_position_embeddings=512)
    return str(directory)


@pytest.fixture(scope="session")
def vllm_server(server_model_dir, tmp_path_factory):
    """One vLLM server on localhost (``rloo-lightning serve``, LoRA adapters of rank 8 on: the adapter sync's
    tests), shared by the server engine's tests; killed at the session's end."""
    from rloo_lightning.engines.vllm import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed")
    from vllm_server_helpers import start_server

    server = start_server(server_model_dir, tmp_path_factory.mktemp("vllm_server"), serve_args=("--lora-rank", "8"))
    yield server
    server.kill()
