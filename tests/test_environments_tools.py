"""Tool use on the environment interface: calls, every error kind, timeouts, the prompt, the masks, the metrics."""

from __future__ import annotations

import json
import time

import pytest
import torch
from module_helpers import retain_policy_logprobs

from rloo_lightning import RLOOModule
from rloo_lightning.data import PromptDataModule, collate_prompts
from rloo_lightning.environments import PolicyTurn
from rloo_lightning.environments.tools import ToolEnvironment, calculator, parse_tool_call, tool_prompt, tool_schemas
from rloo_lightning.engines import GenerationEngine
from rloo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama

TOOLS = ["tool_helpers.add", "tool_helpers.divide", "tool_helpers.hang"]
CALC = "rloo_lightning.environments.tools.calculator"


def _turn(text: str, index: int = 0) -> PolicyTurn:
    return PolicyTurn((), text, index, True)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def env_in_process():
    return ToolEnvironment(TOOLS, timeout=None)


def test_a_valid_call_round_trips_and_an_answer_ends_the_episode(env_in_process):
    env = env_in_process
    env.reset({}, 0)
    step = env.step(_turn("Let me add. " + _call("add", a=2, b=40)))
    assert (step.observation.role, step.observation.content, step.done) == ("tool", "42", False)
    assert env.step(_turn("The answer is 42.", 1)).done
    assert env.metrics()["tool_calls"] == 1 and env.metrics()["tool_errors"] == 0


@pytest.mark.parametrize("text,kind,message", [
    ("<tool_call>{\"name\": \"add\"", "malformed", "not closed"),
    ("<tool_call>{name: add}</tool_call>", "malformed", "not JSON"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", "malformed", "must be {\"name\""),
    (_call("multiply", a=1, b=2), "unknown_tool", "no tool named 'multiply'; tools: add, divide, hang"),
    (_call("add", a=1), "bad_arguments", "missing a required argument: 'b'"),
    (_call("add", a=1, b=2, c=3), "bad_arguments", "unexpected keyword argument 'c'"),
    (_call("add", a="1", b=2), "bad_arguments", "argument 'a' must be of type integer, got str"),
    (_call("divide", a=1, b=0), "exception", "divide raised ZeroDivisionError"),
], ids=["unclosed", "not-json", "no-name", "unknown", "missing-arg", "extra-arg", "wrong-type", "raises"])
def test_each_error_kind_is_told_to_the_policy_and_counted(env_in_process, text, kind, message):
    env = env_in_process
    env.reset({}, 0)
    step = env.step(_turn(text))
    assert step.observation.role == "tool" and not step.done
    assert step.observation.content.startswith(f"error ({kind}): ") and message in step.observation.content
    counts = env.metrics()
    assert counts["tool_errors"] == 1 and counts[f"tool_errors/{kind}"] == 1 and counts["tool_calls"] == 1
    assert sum(counts[f"tool_errors/{k}"] for k in ("malformed", "unknown_tool", "bad_arguments", "exception",
                                                    "timeout")) == 1


@pytest.mark.slow  # a worker process
def test_a_hanging_tool_is_killed_at_its_timeout_and_the_run_goes_on():
    env = ToolEnvironment(TOOLS, timeout=2.0)
    env.reset({}, 0)
    pid = env.pool.pids[0]
    start = time.monotonic()
    step = env.step(_turn(_call("hang", seconds=600)))
    assert time.monotonic() - start < 30
    assert step.observation.content.startswith("error (timeout): hang ran past 2.0 s")
    assert env.metrics()["tool_timeouts"] == 1 and env.metrics()["tool_errors/timeout"] == 1
    assert env.pool.pids[0] != pid  # the hung worker was replaced
    assert env.step(_turn(_call("add", a=1, b=1), 1)).observation.content == "2"  # and the next call works
    assert env.step(_turn(_call("divide", a=1, b=0), 2)).observation.content.startswith("error (exception)")


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("(7 + 5) * 3") == "36" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    for bad in ("__import__('os')", "open('x')", "2 ** 10000", "x + 1", "[1, 2]"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_the_arithmetic_tasks_expression_is_what_the_calculator_answers():
    """The tool-use warm start's calls: every template's prompts parse, and the call computes the row's answer."""
    from rloo_lightning.tasks.arithmetic import TEMPLATES, expression, make_rows

    rows = make_rows(300, 5)
    assert {expression(r["prompt"]).split()[1] for r in rows} == {symbol for _, symbol in TEMPLATES}
    for row in rows:
        assert calculator(expression(row["prompt"])) == row["answer"], row
    for other in ("Mia has 7 pencils and gets 5 more. How many apples does Mia have now? Answer with just the number.",
                  "Mia has 7 pencils and gets 5 more. How many pencils does Mia have now?", "What is 2 + 2?"):
        with pytest.raises(ValueError, match="not an arithmetic-task prompt"):
            expression(other)


def test_tools_need_types_and_docstrings_and_unique_names():
    with pytest.raises(ValueError, match="tool 'untyped': its schema needs a type hint"):
        tool_schemas(["tool_helpers.untyped"])
    with pytest.raises(ValueError, match="cannot be imported"):
        ToolEnvironment(["tool_helpers.nothing_here"], timeout=None)
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolEnvironment(["tool_helpers.add", "tool_helpers.add"], timeout=None)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ToolEnvironment(TOOLS, timeout=0)


def test_parse_tool_call_takes_the_first_call():
    call, error = parse_tool_call("a " + _call("add", a=1, b=2) + _call("divide", a=1, b=2))
    assert error is None and (call.name, call.arguments) == ("add", {"a": 1, "b": 2})


CHAT = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}<e>{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}")
TOOL_CHAT = ("{% if tools %}<s>TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<e>{% endif %}"
             + CHAT)


@pytest.mark.parametrize("template", [CHAT, TOOL_CHAT], ids=["fallback", "template-tools"])
def test_tool_schemas_reach_the_prompt(tmp_path, template):
    from rloo_lightning.data.encode import PromptEncoder

    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyzTOLS:;=")
    tok.add_special_tokens({"additional_special_tokens": ["<s>", "<u>", "<a>", "<t>", "<e>"]})
    tok.chat_template = template
    schemas = tool_schemas([CALC])
    encoder = PromptEncoder(tok, "tok", "prompt", "auto", None, "error", None, 8, None, None, tools=schemas)
    text, templated = encoder.format_prompt("abc", "row 0")
    if template is TOOL_CHAT:
        assert text.startswith("<s>TOOLS:calculator;<e>") and "<tool_call>" not in text
    else:
        assert text.startswith("<s>" + tool_prompt(schemas) + "<e>")
    assert templated and encoder.identity()["tools"] == schemas  # the cache key covers the tools
    with pytest.raises(ValueError, match="cannot be imported"):
        PromptDataModule(task="reverse", tools=["tool_helpers.nothing_here"])


# -- in the module: a scripted policy ------------------------------------------------------------------------------
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789<>/_{}\":,.+*()= |-"


class Scripted(GenerationEngine):
    """Writes ``turns[t]`` at turn t (the same for every row), as ids; not pi_theta (a test of the masks only)."""

    def __init__(self, turns: list[str]) -> None:
        self.turns, self.calls = turns, 0

    def generate(self, model, tokenizer, prompt_ids, prompt_mask, generation_config, seed):
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return torch.tensor([ids] * prompt_ids.shape[0])


def _tool_module(turns, **groups):
    tok = build_char_tokenizer(ALPHABET, model_max_length=256)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=256, seed=0)
    m = RLOOModule("x", rewards={"funcs": ["rloo_lightning.tasks.arithmetic.reward"]},
                   environment={"class_path": "rloo_lightning.environments.tools.ToolEnvironment",
                                "init_args": {"tools": [CALC], "timeout": None}, "max_turns": 3,
                                "reply_format": "|{content}|", "max_context_tokens": 1024},  # past the model's 256
                   sampling={"k": 2, "max_new_tokens": 120}, validation={"at_start": False}, kl={"beta": 0.1},
                   generation_engine=Scripted(turns), **groups)
    m.attach(model, tok)
    m.log = lambda *a, **kw: None
    rows = [{"input_ids": tok("what is 3+4=", add_special_tokens=False)["input_ids"], "prompt": "what is 3+4=",
             "columns": {"answer": "7"}, "row": 0}]
    return m, tok, collate_prompts(rows, tok.pad_token_id)


def test_tool_results_are_context_with_zero_gradient_and_the_answer_is_scored(monkeypatch):
    m, tok, batch = _tool_module([_call("calculator", expression="3+4"), "the answer is 7"])
    kept = retain_policy_logprobs(m, monkeypatch)
    loss = m.training_step(batch, 0)
    loss.backward()
    rollout = kept["rollout"]
    transcript = rollout.columns["transcript"][0]
    assert [t["role"] for t in transcript] == ["assistant", "tool", "assistant"] and transcript[1]["content"] == "7"
    result = (rollout.episodes.context_mask - rollout.completion_mask).bool()
    assert result.sum(1).tolist() == [3, 3]  # "|7|"
    assert (kept["logp"].grad[result] == 0).all()
    assert rollout.scores["reward"].tolist() == [1.0, 1.0]  # the arithmetic reward on the last turn
    assert rollout.episodes.metrics["tool_calls"].tolist() == [1.0, 1.0]


def test_tool_metrics_are_logged_per_episode():
    from rloo_lightning.metrics import train_metric_sums

    m, tok, batch = _tool_module([_call("calculator", expression="3+"), _call("nope"), "7"])
    rollout = m.sample(batch, 2, seed=0)
    rollout.scores, rollout.rewards = m.score(rollout)
    loss, entropy = m.rollout_loss(rollout)
    sums = train_metric_sums(rollout, entropy, loss)
    mean = {name: float(s) / float(n) for name, (s, n) in sums.items()}
    assert mean["train/tool_calls"] == 2.0 and mean["train/tool_errors"] == 2.0
    assert mean["train/tool_errors/exception"] == 1.0 and mean["train/tool_errors/unknown_tool"] == 1.0
    assert mean["train/tool_timeouts"] == 0.0 and mean["train/turns"] == 3.0


def test_tool_episodes_replay_exactly_from_their_seed():
    m, tok, batch = _tool_module([_call("calculator", expression="3+4"), "7"])
    first = m.sample(batch, 2, seed=5)
    m.engine.calls = 0
    again = m.sample(batch, 2, seed=5)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert first.columns["transcript"] == again.columns["transcript"]
