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


# xdist (`--dist loadfile`, pyproject's addopts): which file a worker gets next, and when. Left alone, xdist hands
# out the files with the most tests first, which puts the few-test files that run longest (a module fixture of
# distributed runs, a 135M model) last; and it hands a worker its next file as soon as the worker has 2 tests
# left, so a worker busy with a 2-test file of 80 s also takes the next file, which the other worker, free
# sooner, could have run. At the end one worker runs alone while the other has nothing left. Instead:
# * the most costly file first (longest processing time first), by the rough costs below: seconds of one worker
#   on 2 idle cores (a run's `--durations` summed per file, rounded). A file not listed counts as light and
#   keeps xdist's order (most tests first) after the listed ones. Rough is enough: the order matters, not the
#   figures;
# * a worker gets its next file only once it has 1 test left: that test waits for the next one to be known (for
#   the teardown of its fixtures), so it is when the worker has nothing else to run.
FILE_COST_S = {
    "test_stop_signal.py": 140,
    "test_reliability.py": 125,
    "test_studies.py": 90,
    "test_stop_signal_ranks.py": 80,
    "test_final_checkpoint.py": 80,
    "test_gguf.py": 80,
    "test_sharded.py": 60,
    "test_dynamic_sampling.py": 60,
    "test_multiturn_runs.py": 55,
    "test_cache_integrity.py": 40,
    "test_checkpoint_atomic.py": 40,
    "test_readme_figures.py": 40,
    "test_readme_walk.py": 35,
    "test_console.py": 35,
    "test_cli_output.py": 30,
    "test_options.py": 25,
    "test_cli.py": 20,
    "test_rewards.py": 20,
}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: no error where it is not installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadFileScheduling

    class CostlyFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            # the files not handed out yet, in xdist's order (most tests first): the most costly goes to the front
            # (max keeps the first of equals), and xdist hands the front one to this worker
            name = max(self.workqueue, key=lambda scope: FILE_COST_S.get(scope.rsplit("/", 1)[-1], 0))
            self.workqueue.move_to_end(name, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node):
            # LoadScopeScheduling's, with 1 test left instead of 2 before a worker gets its next file
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return CostlyFileFirst(config, log)


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
