"""Tiny random models and a byte-level BPE tokenizer for tests: no files, no downloads.

``tiny_tokenizer()`` trains a small byte-level BPE in milliseconds (so, as with real tokenizers,
text tokenizes differently at the edges depending on its context) and gives it a ChatML chat
template. ``tiny_llama()`` and ``tiny_qwen2()`` build seeded random models that fit it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .kv.redis_tier import local_redis
from .paged.broker import KVCommBroker
from .config import KVCommConfig
from .engines import hf
from .support import model_fingerprint, rotator_from_config

__all__ = ["local_redis", "CHATML_TEMPLATE", "TOOLS_TEMPLATE", "tiny_tokenizer", "tiny_model", "tiny_llama", "tiny_qwen2", "TINY_CORPUS",
           "PrefixOnlyRuntime"]

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
    config = config_class(**{k: v for k, v in _shape(tokenizer, overrides).items() if v is not None})
    model = model_class(config)
    with torch.no_grad():  # larger weights than the default init, so context visibly matters
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    return model.eval()


def tiny_model(model_class, config_class, tokenizer=None, *, seed: int = 0, **overrides):
    """A seeded random model of any transformers family (``LlamaForCausalLM, LlamaConfig``) in
    :func:`tiny_llama`'s shape, ``overrides`` applied to its config (None drops a field)."""
    tokenizer = tokenizer or tiny_tokenizer()
    overrides.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    return _build(model_class, config_class, tokenizer, seed, overrides)


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


class PrefixOnlyRuntime:
    """A minimal runtime on transformers that does what vLLM does with a claim: load the broker's
    KV for positions ``0 .. claim``, compute the rest, decode, hand the KV back. The reference the
    vLLM connector is checked against (``tests_vllm/``), and the broker's own test bed."""

    def __init__(self, model, tokenizer, *, shared=None, background_capture: bool = False, **config):
        self.model, self.tokenizer = model, tokenizer
        self.background_capture = background_capture  # finish(..., background=True), as the connector does
        self.broker = KVCommBroker(tokenizer, rotator_from_config(model.config), model_fingerprint(model, tokenizer),
                                   KVCommConfig(**config), shared=shared)
        self.count = 0

    def ids(self, messages) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])

    def run(self, ids: list[int], agent: str, *, reuse: bool = True, new_tokens: int = 12,
            forced: Optional[list[int]] = None, prefix_only: bool = False):
        """Prefill the claim's rest and decode greedily (or feed ``forced`` reply ids, e.g. the
        reply another runtime generated); ``prefix_only`` as the connector's request parameter.
        Returns ``(first-token logits, generated ids, report, claim, prefill)``."""
        if forced is not None:
            new_tokens = len(forced)
        self.count += 1
        rid = f"r{self.count}"
        claim = self.broker.plan(rid, ids, agent, reuse=reuse, prefix_only=prefix_only)
        block = self.broker.aligned(rid)
        n, length = len(ids), claim.length
        with torch.inference_mode():
            pre = hf.prefill(self.model, torch.tensor(ids), torch.arange(length, n), block,
                             torch.arange(length) if block is not None else None)
            out, logits = [int(pre.logits.argmax()) if forced is None else forced[0]], pre.logits
            for step in range(new_tokens - 1):
                device = hf.input_device(self.model)
                step_logits = hf.run_forward(self.model, torch.tensor([[out[-1]]], device=device), pre.cache,
                                             position_ids=torch.tensor([[n + step]], device=device))[0, -1]
                out.append(int(step_logits.argmax()) if forced is None else forced[step + 1])
            slots = torch.arange(n + new_tokens - 1)
            report = self.broker.finish(rid, out, lambda positions: hf.kv_at_positions(pre.cache, slots, positions),
                                        background=self.background_capture)
        return logits, out, report, claim, pre

    def dense_logits(self, ids: list[int]) -> torch.Tensor:
        """``[vocab]`` first-token logits of ``ids`` prefilled densely (no reuse, nothing kept):
        the reference a reused request's logits are compared with."""
        with torch.inference_mode():
            return hf.prefill(self.model, torch.tensor(ids), torch.arange(len(ids))).logits
