"""Which agent is calling: the ``@kvcomm_agent`` decorator, else the LangGraph node.

The decorator sets a context variable for the duration of the node function (sync or async);
context variables follow LangChain's executor hops and LangGraph's tasks, so the chat model
called inside the node sees it. The scope holds only for calls made in the node's own run: a
subgraph, task or ``@entrypoint`` the node runs has agents of its own, named by its nodes (put the
decorator under ``@task`` to name a task; a function decorated outside any graph names the calls
it makes outside one). Without the decorator, the node is read from the run's metadata
(``langgraph_node``, and ``langgraph_checkpoint_ns`` for the path of enclosing subgraphs).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TypeVar, Union, overload

from langchain_core.runnables import ensure_config

__all__ = ["kvcomm_agent", "AgentScope", "current_scope", "node_agent"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class AgentScope:
    """An agent name and its per-node options, set by :func:`kvcomm_agent`.

    Attributes:
        name: the agent's name (None: keep the name resolved from the graph).
        reuse: False makes the agent's calls dense (judges, aggregators); None keeps the default.
        namespace: the LangGraph run the decorated node runs in (``langgraph_checkpoint_ns``;
            None outside LangGraph); a call from a subgraph or task the node runs has another.
    """

    name: Optional[str] = None
    reuse: Optional[bool] = None
    namespace: Optional[str] = None

    def covers(self, metadata: Mapping[str, Any]) -> bool:
        """Whether a call made under this run metadata is the decorated node's own (outside
        LangGraph: a call made outside LangGraph too)."""
        return metadata.get("langgraph_checkpoint_ns") == self.namespace


_SCOPE: contextvars.ContextVar[Optional[AgentScope]] = contextvars.ContextVar("kvcomm_agent_scope", default=None)


def current_scope(metadata: Optional[Mapping[str, Any]] = None) -> Optional[AgentScope]:
    """The innermost decorator's scope, if a decorated node is running and the call made under
    ``metadata`` (its run's metadata; None: the current config's) is that node's own."""
    scope = _SCOPE.get()
    if scope is None:
        return None
    if metadata is None:
        metadata = ensure_config().get("metadata") or {}
    return scope if scope.covers(metadata) else None


def _entered(scope: AgentScope) -> AgentScope:
    """The scope bound to the LangGraph run the decorated node starts in."""
    namespace = (ensure_config().get("metadata") or {}).get("langgraph_checkpoint_ns")
    return AgentScope(scope.name, scope.reuse, namespace)


def _is_async(function: Callable) -> bool:
    """A coroutine function, also behind ``functools.partial`` or an object's ``async __call__``
    (not a class: calling it constructs)."""
    if inspect.iscoroutinefunction(function):
        return True
    return not inspect.isclass(function) and inspect.iscoroutinefunction(getattr(function, "__call__", None))


def _name_of(function: Callable) -> str:
    """A function's name, a ``functools.partial``'s function's, else a callable object's class."""
    function = getattr(function, "func", function) if isinstance(function, functools.partial) else function
    return getattr(function, "__name__", None) or type(function).__name__


def node_agent(metadata: Mapping[str, Any]) -> Optional[str]:
    """The LangGraph node that made this run, with the path of enclosing subgraphs
    (``"outer/inner/node"``); None outside LangGraph."""
    node = metadata.get("langgraph_node")
    if not node:
        return None
    namespace = str(metadata.get("langgraph_checkpoint_ns") or "")
    parents = [part.split(":", 1)[0] for part in namespace.split("|") if part][:-1]
    return "/".join([*parents, str(node)])


def _wrap(function: F, scope: AgentScope) -> F:
    if _is_async(function):
        @functools.wraps(function)
        async def async_node(*args, **kwargs):
            token = _SCOPE.set(_entered(scope))
            try:
                return await function(*args, **kwargs)
            finally:
                _SCOPE.reset(token)

        return async_node  # type: ignore[return-value]

    @functools.wraps(function)
    def node(*args, **kwargs):
        token = _SCOPE.set(_entered(scope))
        try:
            return function(*args, **kwargs)
        finally:
            _SCOPE.reset(token)

    return node  # type: ignore[return-value]


@overload
def kvcomm_agent(function: F) -> F: ...
@overload
def kvcomm_agent(name: Optional[str] = None, *, reuse: Optional[bool] = None) -> Callable[[F], F]: ...


def kvcomm_agent(name: Union[str, Callable, None] = None, *, reuse: Optional[bool] = None):
    """Name the agent of a LangGraph node function (sync or async) and carry its options.

    Bare, ``@kvcomm_agent``, the node's function name is the agent (a callable object's class
    name); ``@kvcomm_agent("judge", reuse=False)`` names it and makes its model calls dense (they
    still share their KV). Calls from a subgraph or task the node runs are not the node's: they
    keep their own agent names and options.
    """
    if callable(name):
        return _wrap(name, AgentScope(name=_name_of(name)))
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError("kvcomm_agent takes a non-empty agent name or decorates a function")

    def decorate(function: F) -> F:
        return _wrap(function, AgentScope(name=name or _name_of(function), reuse=reuse))

    return decorate
