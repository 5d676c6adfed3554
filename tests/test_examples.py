"""Every LangGraph example's graph runs end to end on a tiny model (the examples themselves run
the embedded model; see README), and the reporting helper sees every call."""

from langchain_core.messages import HumanMessage

from examples import langgraph_coding, langgraph_debate, langgraph_fanout, langgraph_rag, langgraph_supervisor
from examples.reporting import CallRecorder, print_agent_table
from examples.sandbox import run_isolated
from kvcomm_agents import KVCommEngine
from kvcomm_langgraph import ChatKVComm

QUESTION = "Tom has 3 boxes with 8 pencils each. He gives away 5 pencils. How many pencils does he have now?"


def run(graph, inputs) -> tuple[dict, CallRecorder]:
    recorder = CallRecorder()
    return graph.invoke(inputs, {"callbacks": [recorder]}), recorder


def test_debate_supervisor_rag_and_coding_graphs_run(llama, tokenizer, capsys):
    engine = KVCommEngine(llama, tokenizer)
    model = ChatKVComm(engine=engine, max_tokens=3)
    out, rec = run(langgraph_debate.build_graph(model, 2), {"messages": [HumanMessage(QUESTION)]})
    assert [c.agent for c in rec.calls] == ["solver_1", "solver_2", "judge"] and rec.calls[-1].opted_out
    out, rec = run(langgraph_supervisor.build_graph(model), {"messages": [HumanMessage(QUESTION)], "step": 0})
    assert [c.agent for c in rec.calls] == ["supervisor", "researcher", "supervisor", "analyst", "supervisor", "writer"]
    corpus = {name: langgraph_rag.stdlib_doc(name) for name in ("json.dumps", "shutil.which", "os.path.join")}
    out, rec = run(langgraph_rag.build_graph(model, corpus), {"question": "What does shutil.which return?"})
    assert "shutil.which" in out["documents"] and [c.agent for c in rec.calls] == ["answerer", "critic"]
    problem = langgraph_coding.load_problems(1)[0]
    out, rec = run(langgraph_coding.build_graph(model), {"problem": problem})
    assert out["report"].name == "tester" and isinstance(out["passed"], bool)
    out, rec = run(langgraph_fanout.build_graph(model), {"page": langgraph_rag.stdlib_doc("json"), "answers": []})
    assert sorted(c.agent for c in rec.calls) == ["analyst"] * 4 + ["writer"] and out["summary"] is not None
    assert sum(c.prefix_tokens > 100 for c in rec.calls) == 3  # the page computed once, read by the others
    print_agent_table(rec.calls, rec.calls)
    assert "reuse rate" in capsys.readouterr().out


def test_sandbox_reports_failures_and_timeouts():
    assert run_isolated("print('ok')") == (True, "ok")
    passed, output = run_isolated("import time\nwhile True: time.sleep(0.1)", timeout=1)
    assert not passed and "timed out" in output
    passed, output = run_isolated("assert 1 == 2")
    assert not passed and "AssertionError" in output
