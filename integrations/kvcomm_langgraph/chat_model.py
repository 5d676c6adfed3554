"""``ChatKVComm``: a LangChain chat model over a :class:`kvcomm_agents.KVCommEngine`.

All agents of a process share one engine, so the KV of every reply travels to the agents that
read it. Each call is attributed to an agent (decorator, LangGraph node, constructor, "default"),
which names its reply's segment kind and selects its anchors.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping, Optional, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, ensure_config
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, field_validator, model_validator

from kvcomm_agents import ChatResult as EngineResult
from kvcomm_agents import InvalidRequestError, KVCommEngine
from kvcomm_agents.paged import renders_tools

from .agents import current_scope, node_agent
from .messages import parse_tool_calls, to_engine_messages
from .token_counts import prompt_count, text_ids

__all__ = ["ChatKVComm", "default_engine", "supports_tools"]

_DEFAULT: Optional[KVCommEngine] = None
_DEFAULT_LOCK = threading.Lock()


def default_engine() -> KVCommEngine:
    """The process-wide engine on the embedded SmolLM2-135M-Instruct, loaded on first use."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = KVCommEngine.from_pretrained()
        return _DEFAULT


def model_profile(tokenizer, max_positions: Optional[int]) -> ModelProfile:
    """A text model's profile: ``max_positions`` as its context, tool calling as its template
    allows (no tokenizer: none)."""
    tools = tokenizer is not None and renders_tools(tokenizer)
    profile = ModelProfile(text_inputs=True, text_outputs=True, image_inputs=False, audio_inputs=False,
                           video_inputs=False, pdf_inputs=False, temperature=True, tool_calling=tools,
                           tool_call_streaming=tools, tool_choice=False, structured_output=False)
    if max_positions:
        profile["max_input_tokens"] = max_positions
    return profile


#: The embedded SmolLM2-135M-Instruct's profile, as its files give it (8,192 positions, a template
#: without tools; tests check it against them): stated, so that ``ChatKVComm()`` neither loads nor
#: converts the model to build its profile.
EMBEDDED_PROFILE = model_profile(None, 8192)


def supports_tools(engine: KVCommEngine) -> bool:
    """Whether the engine's chat template renders a ``tools`` list (tool calling possible)."""
    return renders_tools(engine.tokenizer)


#: Call options a call may pass (``invoke(..., temperature=0.7)``, ``bind(...)``, ``bind_tools``);
#: ``tool_choice``, ``parallel_tool_calls`` and ``strict`` are recorded, not enforced (the model
#: decides its calls); LangChain's own ``stream`` switch and ``ls_*`` tracing options pass too.
CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "stop", "seed", "reuse", "tools", "tool_choice",
                "parallel_tool_calls", "strict", "stream")
#: LangChain's settings for remote providers, which its standard tests pass to every chat model:
#: accepted and unused (a local engine has no request to time out, retry or authenticate).
#: ``base_url`` is refused instead: a server is reached with ``engine=VLLMEngine(base_url)``.
REMOTE_SETTINGS = ("timeout", "max_retries", "api_key")
#: Other providers' names for an option, and what ChatKVComm calls it.
RENAMED = {"max_new_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "max_output_tokens": "max_tokens"}


class ChatKVComm(BaseChatModel):
    """Drop-in LangChain chat model that reuses KV across agents.

    Args:
        engine: the shared engine; None means the process-wide default (the embedded model).
        agent: the agent name when neither ``@kvcomm_agent`` nor a LangGraph node names one.
        max_tokens, temperature, top_p, stop, seed: decoding (temperature 0 is greedy; max_tokens
            None: the engine's own, 256 or fewer where the model's positions end).
        reuse: False makes this model's calls dense (they still share their KV).
        streaming: True makes ``invoke`` stream, its tokens reaching callbacks as they come
            (LangChain's switch for it; with tools bound the reply comes whole, at the end).
        timeout, max_retries, api_key: LangChain's remote-provider settings, accepted and
            unused. Any other argument (``model=``, ``base_url=``, ``top_k=``) is refused: an
            engine serves the model it was loaded with, or the server it was given.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Optional[Any] = Field(default=None, exclude=True)
    agent: Optional[str] = Field(default=None, min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Optional[list[str]] = None
    seed: Optional[int] = None
    reuse: Optional[bool] = None
    streaming: bool = False

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, values: Any) -> Any:
        """Refuse what ChatKVComm would otherwise drop without a word: a model named by id (it
        serves the engine it is given) and other providers' options."""
        if not isinstance(values, dict):
            return values
        values = {key: value for key, value in values.items() if key not in REMOTE_SETTINGS}
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = sorted(key for key in values if key not in known)
        if not unknown:
            return values
        if "base_url" in unknown:
            raise ValueError("ChatKVComm reaches a server through its engine: pass "
                             "engine=kvcomm_vllm.client.VLLMEngine(base_url)")
        if {"model", "model_name", "model_id"} & set(unknown):
            raise ValueError("ChatKVComm serves the engine it is given, not a model named by id: pass "
                             "engine=KVCommEngine.from_pretrained(path) (None: the embedded SmolLM2-135M-Instruct)")
        raise ValueError(f"ChatKVComm has no option {', '.join(map(repr, unknown))}{_renamed(unknown)}; it takes engine, agent, "
                         "max_tokens, temperature, top_p, stop, seed, reuse, streaming and LangChain's own settings")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop: Any) -> Any:
        """One stop string is a list of one, as a call's ``stop=`` takes it."""
        return [stop] if isinstance(stop, str) else stop

    @field_validator("engine")
    @classmethod
    def _an_engine(cls, engine: Any) -> Any:
        if engine is not None and not (callable(getattr(engine, "chat", None)) and callable(getattr(engine, "stream", None))):
            raise ValueError(f"engine must be a KVCommEngine (or kvcomm_vllm's VLLMEngine), got {type(engine).__name__}; "
                             "load one with KVCommEngine.from_pretrained(path), or leave it out for the embedded model")
        return engine

    def _resolve_model_profile(self) -> Optional[ModelProfile]:
        """``model.profile``, what LangChain's agents and middleware read of a model: text in and
        out, the context the model's positions cover (``max_input_tokens``; a vLLM server's is
        its own and left out), and tool calling where the chat template renders tools. With no
        engine given, the embedded model's (:data:`EMBEDDED_PROFILE`), without loading it."""
        engine = self.engine if self.engine is not None else _DEFAULT
        if engine is None:
            return dict(EMBEDDED_PROFILE)
        return model_profile(engine.tokenizer, getattr(getattr(engine, "info", None), "max_positions", None))

    @property
    def _llm_type(self) -> str:
        return "kvcomm"

    def __getstate__(self) -> dict[Any, Any]:
        """Pickles with the process-wide default engine as a reference (None: each process uses
        its own default); an explicit engine cannot be pickled (``KVCommEngine`` says why).
        ``copy.deepcopy`` shares the engine (engines copy as themselves)."""
        state = super().__getstate__()
        if _DEFAULT is not None and state["__dict__"].get("engine") is _DEFAULT:
            state = {**state, "__dict__": {**state["__dict__"], "engine": None}}
        return state

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """The model's settings, for tracing (LangChain's cache keys on :meth:`_get_llm_string`)."""
        return {"agent": self.agent, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "stop": self.stop, "seed": self.seed, "reuse": self.reuse}

    def _model_identity(self) -> str:
        """The model's name, with its weights' fingerprint where the engine has one."""
        fingerprint = getattr(self.engine, "fingerprint", None) if self.engine is not None else None
        return f"{self.model_name}@{fingerprint}" if fingerprint else self.model_name

    def _get_llm_string(self, stop: Optional[list[str]] = None, **kwargs: Any) -> str:
        """LangChain's cache key: the model as its weights are now, the agent and reuse this call
        resolves to (a cached reply is one agent's, its segment kind and opt-out included), and
        the options it decodes with, resolved as the call resolves them (the model's own where
        the call leaves one out or passes None)."""
        agent, options = self._resolve(stop, None, kwargs)
        given = {k: v for k, v in kwargs.items() if v is not None}  # None is the model's own, as left out
        key = {**given, **options, "_type": self._llm_type, "model": self._model_identity(), "agent": agent}
        return str(sorted(key.items()))

    @property
    def model_name(self) -> str:
        engine = self.engine
        if engine is None:
            return "kvcomm:embedded-smollm2-135m-instruct"
        if getattr(engine, "model_name", None):  # a remote engine (kvcomm_vllm.client.VLLMEngine)
            return engine.model_name
        return f"kvcomm:{getattr(engine.model.config, '_name_or_path', '') or engine.model.config.model_type}"

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="kvcomm", ls_model_name=kwargs.get("model", self.model_name), ls_model_type="chat",
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        stop = stop if stop is not None else self.stop
        if stop:
            params["ls_stop"] = stop
        return params

    # ---- tools ----------------------------------------------------------------------------
    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Optional[str] = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (rendered by the chat template; replies' ``<tool_call>`` JSON is parsed).

        ``tool_choice`` (and ``parallel_tool_calls``, ``strict``) are recorded but not enforced:
        the model decides whether to call a tool. Other options are refused here, not at the call.

        Raises:
            InvalidRequestError: (a ``ValueError``) the model's chat template has no tool support
                (e.g. the embedded SmolLM2).
        """
        engine = self._engine()
        if not supports_tools(engine):
            raise InvalidRequestError(
                f"{self.model_name}: this model's chat template does not render tools, so tool calling "
                "cannot work. Use a model whose template supports tools (Qwen2.5-Instruct style "
                "<tool_call> JSON), or call the model without tools."
            )
        _check_call_options(kwargs)
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    # ---- token counts ---------------------------------------------------------------------
    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s ids from the served model's tokenizer (LangChain's own default fetches
        GPT-2's from the model hub: :mod:`.token_counts`); ``custom_get_token_ids`` where given."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return text_ids(self._engine().tokenizer, text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Optional[Sequence[Any]] = None) -> int:
        """The prompt tokens a call with ``messages`` (and ``tools``) takes, as its
        ``usage_metadata["input_tokens"]`` gives them: the chat template's rendering, the
        generation header included. A list the template refuses as a prompt (``trim_messages``
        counts histories reversed) is counted message by message (:mod:`.token_counts`)."""
        formatted = [convert_to_openai_tool(tool) for tool in tools] if tools else None
        return prompt_count(self._engine().tokenizer, to_engine_messages(messages), formatted)

    # ---- calls ----------------------------------------------------------------------------
    def _engine(self) -> KVCommEngine:
        return self.engine if self.engine is not None else default_engine()

    def _resolve(self, stop: Optional[list[str]], run_manager: Optional[CallbackManagerForLLMRun], kwargs: dict):
        _check_call_options(kwargs)
        # The node's metadata is in the config the runnable runs under; a run manager adds the
        # call's own (LangChain streams an invoke without one: streaming=True, astream_events).
        # The cache key (no run manager) resolves from the same config.
        metadata = {**(ensure_config().get("metadata") or {}), **(run_manager.metadata if run_manager is not None else {})}
        agent, reuse = self._agent_and_reuse(metadata, kwargs)
        if stop is None:
            stop = _given(kwargs, "stop", self.stop)
        options = dict(
            max_new_tokens=_given(kwargs, "max_tokens", self.max_tokens),
            temperature=_given(kwargs, "temperature", self.temperature),
            top_p=_given(kwargs, "top_p", self.top_p),
            stop=stop or None,
            seed=_given(kwargs, "seed", self.seed),
            reuse=reuse,
            tools=kwargs.get("tools"),
        )
        return agent, options

    def _agent_and_reuse(self, metadata: Mapping[str, Any], kwargs: dict) -> tuple[str, Optional[bool]]:
        """The calling agent (decorator, LangGraph node, constructor, "default") and its reuse."""
        scope = current_scope(metadata)
        agent = (scope.name if scope and scope.name else None) or node_agent(metadata) or self.agent or "default"
        reuse = _given(kwargs, "reuse", scope.reuse if scope and scope.reuse is not None else self.reuse)
        return agent, reuse

    def _message(self, result: EngineResult, agent: str, tools_bound: bool, chunk: bool = False):
        stats = result.stats
        usage = UsageMetadata(
            input_tokens=stats.prompt_tokens, output_tokens=stats.generated_tokens,
            total_tokens=stats.prompt_tokens + stats.generated_tokens,
            input_token_details={"cache_read": stats.reused_tokens},
        )
        text, calls, invalid = parse_tool_calls(result.text) if tools_bound else (result.text, [], [])
        metadata = {
            "model_name": self.model_name,
            "finish_reason": _finish_reason(result, bool(calls)),
            "kvcomm": {"agent": agent, "segment": result.segment.model_dump() if result.segment else None,
                       "finish_reason": result.finish_reason, "stats": stats.model_dump(mode="json")},
        }
        if chunk:
            # A chunk carries calls as raw argument strings that LangChain parses when chunks are
            # added up; a malformed call keeps the text the model wrote, tags included, so that it
            # cannot parse as a valid call (the parse error itself has no place in a chunk).
            chunks = [tool_call_chunk(name=c["name"], args=_json(c["args"]), id=c["id"], index=i) for i, c in enumerate(calls)]
            chunks += [tool_call_chunk(name=c["name"], args=f"<tool_call>{c['args']}</tool_call>", id=c["id"], index=len(calls) + i)
                       for i, c in enumerate(invalid)]
            return AIMessageChunk(content=text if tools_bound else "", usage_metadata=usage, response_metadata=metadata,
                                  tool_call_chunks=chunks, chunk_position="last")
        return AIMessage(content=text, usage_metadata=usage, response_metadata=metadata,
                         tool_calls=calls, invalid_tool_calls=invalid)

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        agent, options = self._resolve(stop, run_manager, kwargs)
        result = self._engine().chat(to_engine_messages(messages), agent=agent, **options)
        message = self._message(result, agent, bool(options["tools"]))
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=_info(message))])

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        agent, options = self._resolve(stop, run_manager, kwargs)
        tools_bound = bool(options["tools"])
        result = None
        for item in self._engine().stream(to_engine_messages(messages), agent=agent, **options):
            if isinstance(item, EngineResult):
                result = item
            elif not tools_bound:  # with tools the reply is parsed whole, at the end
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=item))
                if run_manager is not None:
                    run_manager.on_llm_new_token(item, chunk=chunk)
                yield chunk
        assert result is not None
        message = self._message(result, agent, tools_bound, chunk=True)
        yield ChatGenerationChunk(message=message, generation_info=_info(message))


def _finish_reason(result: EngineResult, called: bool) -> str:
    """The reply's finish reason as OpenAI's chat models name it, which LangChain providers
    pass on: ``"tool_calls"`` for a reply with tool calls that ended (an end-of-sequence id or a
    stop string), else ``"stop"`` for either; ``"length"`` as it is
    (``response_metadata["kvcomm"]["finish_reason"]`` keeps the engine's own)."""
    if result.finish_reason in ("stop", "stop_string"):
        return "tool_calls" if called else "stop"
    return result.finish_reason


def _info(message: BaseMessage) -> dict:
    """A generation's info: its finish reason, as its message's metadata gives it."""
    return {"finish_reason": message.response_metadata["finish_reason"]}


def _given(kwargs: dict, option: str, default: Any) -> Any:
    """A call option, the model's own where the call leaves it out or passes None (as other
    providers read None)."""
    value = kwargs.get(option)
    return default if value is None else value


def _check_call_options(kwargs: dict) -> None:
    """Refuse call options ChatKVComm would ignore (one generation per call: no ``n``)."""
    if kwargs.get("n", 1) != 1:
        raise InvalidRequestError(f"ChatKVComm generates one reply per call, got n={kwargs['n']!r}; call it n times")
    unknown = sorted(k for k in kwargs if k not in CALL_OPTIONS and k != "n" and not k.startswith("ls_"))
    if unknown:
        raise InvalidRequestError(f"ChatKVComm has no call option {', '.join(map(repr, unknown))}{_renamed(unknown)}; "
                                  f"it takes {', '.join(CALL_OPTIONS)}")


def _renamed(options: Sequence[str]) -> str:
    """What ChatKVComm calls the options another provider names otherwise ("" for none)."""
    return "".join(f"; {key!r} is {RENAMED[key]!r} here" for key in options if key in RENAMED)


def _json(args: dict) -> str:
    import json

    return json.dumps(args)
