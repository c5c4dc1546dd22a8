"""Chat templates in the style of the model families, on an offline byte-level BPE tokenizer whose turn markers are
special tokens (so that a marker and the text around it could merge if they were handled wrongly)."""

from __future__ import annotations

from functools import lru_cache

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
            "<tool_call>"]

# Written as the families write theirs: literal text inside {{ '...' }} (transformers renders with trim_blocks).
# Qwen-style ChatML: a tool result goes inside a *user* turn, wrapped in <tool_response> (plain text, not a token).
CHATML_TOOLS_IN_USER = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

# Llama-3-style headers: a tool result has its own header ("ipython"), and every content is trimmed.
LLAMA3_HEADERS = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n' }}"
    "{{- m.content | trim }}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

# Phi-style role tokens with a default system message, and a tool turn closed by another marker than a user turn.
DEFAULT_SYSTEM = (
    "{%- if messages[0].role != 'system' %}{{ '<|system|>\\nYou are a careful assistant.<|end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{ '<|tool|>\\n' + m.content + '<|endoftext|>\\n' }}"
    "{%- else %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}")

TEMPLATES = {"chatml-tools-in-user": (CHATML_TOOLS_IN_USER, "<|im_end|>"),
             "llama3-headers": (LLAMA3_HEADERS, "<|eot_id|>"),
             "default-system": (DEFAULT_SYSTEM, "<|end|>")}

_CORPUS = ["the answer is 42", "what is 3 + 4? it is 7", "call the calculator tool with an expression",
           "error (unknown_tool): no tool named", "You are a careful assistant.", "tool_response result json",
           '{"name": "calculator", "arguments": {"expression": "7 * 8"}}', "no, try again", "the secret word",
           "user assistant system ipython hello world"] * 20


@lru_cache(maxsize=None)
def _bpe_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(_CORPUS, trainer)
    return core.to_str()


def bpe_tokenizer(template: str | None = None):
    """A byte-level BPE tokenizer trained in code on a small corpus; its markers are special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_bpe_json()), bos_token="<|begin_of_text|>",
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tok.chat_template = template
    return tok
