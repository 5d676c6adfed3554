"""vLLM in the benchmark's process, driven as ``kvcomm_vllm.client.VLLMEngine`` drives a server
(``benchmarks.vllm_serving`` runs one strategy per process through it): prompts rendered on the
client side, the connector's settings per strategy, and the client's copies (prefill ahead after
a call's first token, replies ahead every ``CHUNK`` reply ids) added to vLLM's engine step by
step, as a streaming client sends them.
"""

from __future__ import annotations

import os


class VLLMDriver:
    """vLLM in this process with a strategy's settings (``benchmarks.vllm_serving.STRATEGIES``),
    driven as the SDK's client drives a server: prompts rendered here, copies sent as
    ``VLLMEngine`` sends them (``connector-ahead``, ``connector-replies``)."""

    def __init__(self, strategy: str, model: str):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM

        kwargs = dict(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, max_logprobs=-1,
                      seed=0, disable_log_stats=False)
        if strategy.startswith("connector"):
            from kvcomm_vllm import engine_kwargs

            kwargs.update(engine_kwargs({"kl_budget": None} if strategy == "connector-unaudited" else None,
                                        background_capture=strategy == "connector-background-capture"))
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the same process layout as the connector
            kwargs.update(enable_prefix_caching=strategy.startswith("vllm-apc"), distributed_executor_backend="uni")
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.ahead = self.replies = None
        if strategy in ("connector-ahead", "connector-replies", "vllm-apc-copies"):
            from kvcomm_vllm.text_ahead import PrefillAhead

            self.ahead = PrefillAhead()
        if strategy in ("connector-replies", "vllm-apc-copies"):
            from kvcomm_vllm.reply_ahead import ReplyAhead

            self.replies = ReplyAhead()
        self._spans: dict[tuple, list] = {}
        self._count = 0

    def ids(self, messages) -> list[int]:
        from kvcomm_agents.prompt import render_prompt

        layout = render_prompt(self.tokenizer, messages)
        ids = layout.ids.tolist()
        self._spans[tuple(ids)] = [layout.tokens_within(*span) for span in layout.content_spans if span is not None]
        return ids

    def generate(self, prompts: list[list[int]], agents: list[str], max_tokens: int, *, reuse: bool = True,
                 logprobs=None):
        """The prompts' outputs; with prefill-ahead, each prompt's copies ride in the same batch
        (one token each, their outputs dropped), as ``VLLMEngine`` sends them."""
        from vllm import SamplingParams

        def params(agent, tokens, lp=None):
            return SamplingParams(max_tokens=tokens, temperature=0, logprobs=lp,
                                  extra_args={"kv_transfer_params": {"agent": agent, "reuse": reuse}})

        copies = [[] for _ in prompts]  # per prompt
        if self.ahead is not None and reuse:
            for i, (ids, agent) in enumerate(zip(prompts, agents)):
                spans = self._spans.get(tuple(ids), [])
                copies[i] = self.ahead.copies_for(agent, ids, spans)
                self.ahead.learn(agent, ids, spans)
        if self.ahead is not None or self.replies is not None:
            return self._stepped(prompts, agents, copies, max_tokens, reuse, logprobs, params)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], [params(a, max_tokens, logprobs) for a in agents],
                                 use_tqdm=False)
        return outs

    def _stepped(self, prompts, agents, copies, max_tokens, reuse, logprobs, params):
        """:meth:`generate` stepped on the engine, as a streaming ``VLLMEngine`` sees it: each
        prompt's prefill-ahead ``copies`` are added once its first token is out (they ride on its
        decode steps, never on its prefill), and every :data:`~kvcomm_vllm.reply_ahead.CHUNK`
        new reply ids one ``prefix_only`` copy per learned reader of its reply. Copies still
        running when the prompts finish go on beside the next ones."""
        from vllm.sampling_params import RequestOutputKind

        from kvcomm_vllm.reply_ahead import CHUNK, copy_prompt
        from kvcomm_vllm.client import COPY_PRIORITY

        engine = self.llm.llm_engine

        def add_copy(reader, ids, prefix_only=False):
            self._count += 1
            copy = params(reader, 1)
            if prefix_only:
                copy.extra_args["kv_transfer_params"]["prefix_only"] = True
            engine.add_request(f"copy-{self._count}", {"prompt_token_ids": ids}, copy, priority=COPY_PRIORITY)

        pending = {}  # request id -> [prompt ids, agent, reply ids sent so far, shared copies, reply bases]
        order = []
        for i, (ids, agent) in enumerate(zip(prompts, agents)):
            self._count += 1
            key = f"main-{self._count}"
            bases = []
            if reuse and self.replies is not None:
                self.replies.learn(agent, ids)
                bases = self.replies.bases(agent, ids)
            sampling = params(agent, max_tokens, logprobs)
            sampling.output_kind = RequestOutputKind.CUMULATIVE
            given = engine.add_request(key, {"prompt_token_ids": ids}, sampling)
            pending[key] = [ids, agent, 0, copies[i], bases]
            order.append(pending[key])
            if given != key:  # vLLM may suffix the id; outputs carry one or the other
                pending[given] = pending[key]
        finished = {}
        while len(finished) < len(prompts):
            if not engine.has_unfinished_requests():
                raise RuntimeError("a request ended without a final output (aborted?)")
            for out in engine.step():
                state = pending.get(out.request_id)
                if state is None or id(state) in finished:
                    continue
                ids, agent, sent, shared, bases = state
                for reader, copy in shared:  # after the first token
                    add_copy(reader, copy)
                state[3] = []
                reply = self.tokenizer(out.outputs[0].text, add_special_tokens=False)["input_ids"]
                if out.finished:
                    finished[id(state)] = out
                    if reuse and self.replies is not None:
                        self.replies.finished(agent, ids, reply)
                elif bases and len(reply) >= sent + CHUNK:
                    state[2] = len(reply)
                    for reader, base in bases:
                        add_copy(reader, copy_prompt(base, reply), prefix_only=True)
        return [finished[id(state)] for state in order]
