"""The public names and the core's independence from LangChain, LangGraph and gguf."""

import subprocess
import sys

import kvcomm_agents

EXPECTED = {
    "KVCommEngine", "KVCommConfig", "ExperimentalSettings", "SegmentRef", "ChatResult", "CallStats", "SegmentDecision",
    "GateRecord", "ReuseSummary", "Replay", "StoreStats", "KVCommError", "UnsupportedModelError", "RopeCheckError",
    "ModelNotAvailableError", "AnchorFileError", "InvalidRequestError", "InvalidMessagesError", "BudgetWarning", "SharedTierWarning",
}


def test_all_is_curated():
    assert set(kvcomm_agents.__all__) == EXPECTED
    for name in kvcomm_agents.__all__:
        assert getattr(kvcomm_agents, name) is not None


def test_core_imports_without_langchain_langgraph_or_gguf():
    code = (
        "import sys\n"
        "for name in ('langchain_core', 'langgraph', 'langchain', 'gguf'):\n"
        "    sys.modules[name] = None  # makes 'import name' fail\n"
        "import pkgutil, importlib, kvcomm_agents\n"
        "for m in pkgutil.walk_packages(kvcomm_agents.__path__, 'kvcomm_agents.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('langchain_core', 'langgraph', 'langchain') and sys.modules[m] is not None]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
