"""What the server engine's tests against the stand-in share (``test_engines_vllm_server_client.py``,
``test_engines_vllm_server_liveness.py``): the fixtures (``standin``, ``engines``, ``policy``, the key) and small
helpers. A test module imports the fixtures it uses by name."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rloo_lightning.engines.vllm_http import ServerClient
from rloo_lightning.engines.vllm_server import VLLMServerEngine
from rloo_lightning.models.loading import load_tokenizer
from standin_vllm_server import StandinVLLM

KEY = "standin-key-0123"
ROWS = 4  # two prompts, two samples each
#: The engines' liveness_timeout and liveness_interval in these tests: short, yet long enough that the stand-in on a
#: loaded machine never looks down when it is not; the reconnect_timeout of the tests where a server stays down; and
#: the slack the time bounds allow (upper bounds only).
LIVE, TICK, RECONNECT, SLACK = 2.0, 0.25, 1, 5


@pytest.fixture(autouse=True)
def server_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)


@pytest.fixture
def standin(tiny_model_dir):
    with StandinVLLM(tiny_model_dir, KEY) as server:
        yield server


@pytest.fixture
def engines(tmp_path):
    """``engines(server or [servers], **options)``: a VLLMServerEngine on stand-ins (sync folder in tmp_path, small
    timeouts), closed at the test's end."""
    made = []

    def make(server, **options):
        options = {"sync_dir": str(tmp_path / "sync"), "connect_timeout": 5, "request_timeout": 30,
                   "reconnect_timeout": 5, "retries": 2, "liveness_timeout": LIVE, "liveness_interval": TICK,
                   **options}
        servers = server if isinstance(server, (list, tuple)) else [server]
        engine = VLLMServerEngine(urls=[s.url for s in servers], **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def policy(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = load_tokenizer(tiny_model_dir)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ids, mask = prompts(tok, ["abc=", "hgfedc="], k=ROWS // 2)
    return model, tok, config, ids, mask


@pytest.fixture
def waiting(monkeypatch) -> threading.Event:
    """Set when an engine says that it found a server down and waits for it (``.lines``: what it said)."""
    event = threading.Event()
    event.lines = []

    def say(self, line: str) -> None:
        event.lines.append(line)
        event.set()

    monkeypatch.setattr(ServerClient, "say", say)
    return event


def prompts(tok, texts: list[str], k: int):
    rows = [tok(text, add_special_tokens=False)["input_ids"] for text in texts for _ in range(k)]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def step(model, seed: int, scale: float = 0.05) -> None:
    """An update the canary sees: every weight moved by seeded noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def weights_equal(server: StandinVLLM, model) -> bool:
    held = server.state_dict()
    return all(torch.equal(held[name], tensor) for name, tensor in model.state_dict().items())


def one_line(err) -> str:
    """The message of a ``pytest.raises`` result, checked to be one line."""
    text = str(err.value)
    assert "\n" not in text, text
    return text


def held_rows(standin: StandinVLLM, engine, policy, seed: int):
    """A batch submitted whose rows the stand-in holds without an answer (long generations in flight)."""
    model, tok, config, ids, mask = policy
    standin.fail_next(ROWS, "hold", on="row")
    handle = engine.submit(model, tok, ids, mask, config, seed=seed)
    standin.wait_for(lambda s: len(s.held("row")) == ROWS)
    return handle
