"""kvcomm-agents: cross-agent KV-cache reuse for multi-agent LLM systems on local HF models."""

from .config import ExperimentalSettings, KVCommConfig
from .engine import KVCommEngine
from . import errors
from .errors import (
    AnchorFileError,
    BudgetWarning,
    InvalidMessagesError,
    InvalidRequestError,
    KVCommError,
    ModelNotAvailableError,
    RopeCheckError,
    SharedTierWarning,
    UnsupportedModelError,
)
from .evaluation import Replay
from .kv.segments import SegmentRef
from .kv.store import StoreStats
from .plan import GateRecord, SegmentDecision
from .results import CallStats, ChatResult, ReuseSummary

__version__ = "0.1.0"

__all__ = [
    "KVCommEngine",
    "KVCommConfig",
    "ExperimentalSettings",
    "SegmentRef",
    "ChatResult",
    "CallStats",
    "SegmentDecision",
    "GateRecord",
    "ReuseSummary",
    "Replay",
    "StoreStats",
    *errors.__all__,
]
