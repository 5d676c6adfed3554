"""The runtime-neutral side of paged engines (vLLM with the KVCOMM connector), and everything such
a runtime's adapter needs from the core, under one public name.

- :mod:`.claims`: what a request may claim of stored KV without holes;
- :mod:`.broker`: :class:`KVCommBroker`, which plans, claims and captures for a runtime that
  owns its own cache;
- re-exported for adapters: the KV block a runtime fills (:class:`KVBlock`), the RoPE check at
  load (:func:`rotator_from_config`), the prompt renderer (:func:`render_prompt`) and its message checks (:func:`normalize_messages`), whether a chat template renders tools
  (:func:`renders_tools`), the ``reuse`` argument's check (:func:`check_reuse`), the reply budget of
  a call that names none (:func:`default_reply_budget`), the token-run index a router scores prompts with (:class:`TokenRunIndex`, :func:`scan`), the Redis segment
  tier (:class:`RedisSegments`, and :func:`local_redis`, a throwaway server for demos and tests) and the embedded model's folder (:func:`embedded_model_dir`).
"""

from ..checks import check_reuse, default_reply_budget
from ..embedded import embedded_model_dir
from ..kv.block import KVBlock
from ..kv.redis_tier import RedisSegments, local_redis
from ..kv.run_index import TokenRunIndex, scan
from ..prompt import normalize_messages, render_prompt, renders_tools
from ..support import rotator_from_config
from .broker import KVCommBroker, for_runtime
from .claims import Claim, contiguous_claim

__all__ = ["KVCommBroker", "for_runtime", "Claim", "contiguous_claim", "KVBlock", "RedisSegments", "local_redis", "TokenRunIndex",
           "scan", "render_prompt", "normalize_messages", "renders_tools", "check_reuse", "default_reply_budget",
           "rotator_from_config", "embedded_model_dir"]
