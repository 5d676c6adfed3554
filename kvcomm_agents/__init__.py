"""kvcomm-agents: cross-agent KV-cache reuse for multi-agent LLM systems on local HF models."""

from .cache.segments import SegmentRef
from .cache.store import StoreStats
from .config import KVCommConfig
from .engine import KVCommEngine
from .errors import (
    InvalidMessagesError,
    KVCommError,
    ModelNotAvailableError,
    RopeCheckError,
    UnsupportedModelError,
)
from .plan import GateRecord, SegmentDecision
from .results import CallStats, ChatResult, ReuseSummary

__version__ = "0.1.0"

__all__ = [
    "KVCommEngine",
    "KVCommConfig",
    "SegmentRef",
    "ChatResult",
    "CallStats",
    "SegmentDecision",
    "GateRecord",
    "ReuseSummary",
    "StoreStats",
    "KVCommError",
    "UnsupportedModelError",
    "RopeCheckError",
    "ModelNotAvailableError",
    "InvalidMessagesError",
]
