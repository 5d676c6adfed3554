"""Tiny random models and a byte-level BPE tokenizer for tests: no files, no downloads.

``tiny_tokenizer()`` trains a small byte-level BPE in milliseconds (so, as with real tokenizers,
text tokenizes differently at the edges depending on its context) and gives it a ChatML chat
template. ``tiny_llama()`` and ``tiny_qwen2()`` build seeded random models that fit it.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

__all__ = ["CHATML_TEMPLATE", "TOOLS_TEMPLATE", "tiny_tokenizer", "tiny_llama", "tiny_qwen2", "TINY_CORPUS"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: ChatML with tool support in the ``<tool_call>`` JSON style of Qwen2.5-Instruct: tools listed in
#: the system turn, calls rendered as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
#: tool results as ``<tool_response>`` user turns.
TOOLS_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else none %}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}{% if system %}{{ system + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n' }}"
    "{%- elif system %}{{ '<|im_start|>system\n' + system + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? Let us think step by step.",
    "You are a careful math solver. Answer the question and give the final number.",
    "Agent 1 said: the answer is 72 because 48 plus 24 equals 72.",
    "The quick brown fox jumps over the lazy dog while the agents debate the answer.",
    "def add(a, b):\n    return a + b\n",
    "system user assistant tool answer question reply final number because therefore",
]


@lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_CORPUS * 4, trainer=trainer)
    return tokenizer.to_str()


def tiny_tokenizer(vocab_size: int = 400, chat_template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML special tokens and chat template."""
    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def _shape(tokenizer, overrides: dict) -> dict:
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    shape.update(overrides)
    return shape


def _build(model_class, config_class, tokenizer, seed: int, overrides: dict):
    torch.manual_seed(seed)
    config = config_class(**_shape(tokenizer, overrides))
    model = model_class(config)
    with torch.no_grad():  # larger weights than the default init, so context visibly matters
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    return model.eval()


def tiny_llama(tokenizer=None, *, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A seeded random Llama (3 layers, 4 query / 2 KV heads, head_dim 16) for ``tokenizer``."""
    tokenizer = tokenizer or tiny_tokenizer()
    overrides.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    return _build(LlamaForCausalLM, LlamaConfig, tokenizer, seed, overrides)


def tiny_qwen2(tokenizer=None, *, seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A seeded random Qwen2 (attention biases, tied sizes as ``tiny_llama``) for ``tokenizer``."""
    tokenizer = tokenizer or tiny_tokenizer()
    overrides.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000000.0})
    return _build(Qwen2ForCausalLM, Qwen2Config, tokenizer, seed, overrides)
