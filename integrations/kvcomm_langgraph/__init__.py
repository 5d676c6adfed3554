"""LangGraph and LangChain integration of kvcomm-agents.

    from kvcomm_langgraph import ChatKVComm, kvcomm_agent

``ChatKVComm()`` is a drop-in chat model on one engine shared by every agent of the process;
``@kvcomm_agent`` names a node's agent explicitly and carries per-node options such as
``reuse=False`` for judges. Uses only ``kvcomm_agents``' public names.
"""

from .agents import AgentScope, kvcomm_agent
from .chat_model import ChatKVComm, default_engine, supports_tools
from .messages import parse_tool_calls, to_engine_messages

__all__ = ["ChatKVComm", "kvcomm_agent", "AgentScope", "default_engine", "supports_tools",
           "to_engine_messages", "parse_tool_calls"]
