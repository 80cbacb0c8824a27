"""tools.trace_request's rank tracer, on a fake command queue (no engine is started here)."""
from __future__ import annotations

import json
import queue

from tools import trace_request as tr


def test_traced_commands_trace_one_generate_until_the_next_command(tmp_path, monkeypatch):
    """A rank is traced from the generate command it receives until it asks for the next command, and writes the
    project functions it entered to rank<R>.json; calls outside that window are not recorded."""
    from engine.model.sampling import SamplingParams
    from engine.requests import prompt_length_error

    monkeypatch.setenv(tr.OUT_ENV, str(tmp_path))
    q = queue.Queue()
    for cmd in (("generate", [], None), ("stop",)):
        q.put(cmd)
    cmds = tr.TracedCommands(q, rank=1)
    prompt_length_error(8, 64)                             # before the window: not recorded
    assert cmds.get()[0] == "generate" and cmds.tracer is not None
    SamplingParams(max_new_tokens=4)                       # inside the window
    assert cmds.get()[0] == "stop" and cmds.tracer is None
    seen = {tuple(x) for x in json.loads((tmp_path / "rank1.json").read_text())}
    fns = tr.named(seen)
    assert any(f.endswith("engine/model/sampling.py") and q.startswith("SamplingParams.") for f, q in fns), fns
    assert not any(q == "prompt_length_error" for _, q in fns), fns
    assert all(f.startswith(tr.PROJECT) for f, _ in fns)
    assert not any(q.rsplit(".", 1)[-1].startswith("<") for _, q in fns)


def test_named_drops_module_bodies_lambdas_and_comprehensions():
    seen = {("a.py", "f"), ("a.py", "C.m"), ("a.py", "<module>"), ("b.py", "f.<locals>.<lambda>"),
            ("b.py", "g.<locals>.<listcomp>")}
    assert tr.named(seen) == {("a.py", "f"), ("a.py", "C.m")}
