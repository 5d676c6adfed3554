"""Copies: text computed, ahead of time, in the context a later reader will read it in.

A reply's KV depends on the text before it. The sender computes its reply after its own prompt,
readers paste it after theirs; shared input (a task, a document) is first computed after one
agent's system text and read after others'. So no version of that KV fits the readers, and
each would estimate offsets or compute the text again. A *copy* computes it once more, inside
the sender's own forwards, after the text its reader will have before it, so the reader's
planner finds an exact version (:mod:`kvcomm_agents.versions`).

- :mod:`.rules`: what is learned from readers' prompts (ids only), shared with the vLLM client's
  copies (``kvcomm_vllm.text_ahead``, ``kvcomm_vllm.reply_ahead``);
- :mod:`.replies`: the framings readers give a sender's replies (lead-in, lead-out);
- :mod:`.texts`: the prefixes readers put before shared text;
- :mod:`.decode`: :class:`FramedDecode`, the copies fed with the sender's forwards (a 4-D mask
  keeps them apart);
- :mod:`.cost`: :class:`~.cost.CopyCost`, whether each kind of copy costs less than the prefill
  it spares (measured on the engine's calls);
- :mod:`.record`: the copies recorded as versions after the reply;
- :mod:`.framer`: :class:`Framer`, the one object a call talks to.
"""

from .decode import FramedDecode, TextCopy
from .framer import Framer
from .replies import FramingRule
from .rules import (ALIGN_IDS, COVERED, MAX_CONTEXTS, MAX_LEAD_IN, MAX_PREFIX, MAX_READERS, ReaderRule,
                    ReadersByContext, align_lead_in)

__all__ = ["Framer", "FramedDecode", "TextCopy", "FramingRule", "ReaderRule", "ReadersByContext", "align_lead_in",
           "ALIGN_IDS", "COVERED", "MAX_CONTEXTS", "MAX_LEAD_IN", "MAX_PREFIX", "MAX_READERS"]
