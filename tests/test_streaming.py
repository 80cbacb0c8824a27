"""Token streaming: ``LLM.generate(stream=...)`` reports every committed token once, in order, step by step (not all at
the end), at pp=1 and pp=2, with and without EAGLE; ``harness.core.textstream.TextStream`` prints the same text the
completion holds, a multi-byte character split across tokens once whole."""
from __future__ import annotations

import io

import pytest

from engine import LLM, EngineConfig, SamplingParams, SpecConfig
from harness.core.textstream import TextStream


@pytest.mark.parametrize("pp,spec", [(1, False), (1, True), (2, False), (2, True)])
def test_stream_reports_every_token_in_order(tiny_model_dir, tiny_draft_dir, tiny_prompts, pp, spec):
    sc = SpecConfig(draft=str(tiny_draft_dir), pp_spec=pp > 1) if spec else SpecConfig()
    calls, got = [], {}

    def stream(updates):
        calls.append(updates)
        for i, ids in updates:
            got.setdefault(i, []).extend(ids)
    with LLM(EngineConfig(model=str(tiny_model_dir), pp=pp, spec=sc)) as llm:
        outs = llm.generate(tiny_prompts[:3], SamplingParams(max_new_tokens=20, ignore_eos=True), stream=stream)
    assert got == {i: o.token_ids for i, o in enumerate(outs)}
    assert all(len(o.token_ids) == 20 for o in outs)
    assert len(calls) >= 20 // (4 if spec else 1)       # step by step: at most S+1 tokens a round per request
    assert all(ids for u in calls for _, ids in u)       # no empty update


class _ByteTokenizer:
    """Each token id is one byte of UTF-8; decode replaces an incomplete sequence with U+FFFD (as HF tokenizers do)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_textstream_holds_back_split_characters_and_matches_the_text():
    text = "2+3 = 5 — «ok» 数字"
    data = list(text.encode())
    out = io.StringIO()
    s = TextStream(_ByteTokenizer(), out)
    writes = []
    for b in data:
        before = out.getvalue()
        s.on_tokens([(0, [b])])
        writes.append(out.getvalue()[len(before):])
    assert "\ufffd" not in out.getvalue()
    assert out.getvalue() == text                        # all of it streamed before close
    s.close(text)
    assert out.getvalue() == text + "\n"
    assert sum(bool(w) for w in writes) == len(text)     # one write per whole character


def test_textstream_without_streamed_tokens_prints_the_final_text():
    out = io.StringIO()
    s = TextStream(_ByteTokenizer(), out)
    s.close("The answer is 5")
    assert out.getvalue() == "The answer is 5\n"


def test_textstream_end_line_ends_a_cut_stream_once():
    out = io.StringIO()
    s = TextStream(_ByteTokenizer(), out)
    s.end_line()
    assert out.getvalue() == ""                          # nothing printed: nothing to end
    s.on_tokens([(0, list(b"The answer"))])
    s.end_line()
    s.end_line()
    assert out.getvalue() == "The answer\n"


def test_an_interrupt_mid_stream_ends_the_printed_line(tiny_model_dir):
    """Regression: ^C while ``generate`` streamed left the streamed text without its newline (the shell's prompt
    then starts after it). Once the first bytes are out, SIGINT still ends the command with 130 and the one
    interrupt line, and stdout ends with a newline."""
    import signal
    import subprocess
    import sys
    from pathlib import Path
    p = subprocess.Popen([sys.executable, "-m", "harness", "generate", "hello", "--model", str(tiny_model_dir),
                          "--device", "cpu", "--no-spec", "--max-new-tokens", "2000", "--set", "max_model_len=4096"],
                         cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(1)                             # the first streamed byte
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=120)
    out = (first + rest).decode()
    assert p.returncode == 130 and err.decode().startswith("ppspec: interrupted (SIGINT)"), err[-2000:]
    assert len(out) > 1 and out.endswith("\n"), out[-200:]
