"""The commands that run the engine on a workload: ``gsm8k``, ``bench``, ``gate``, ``generate``.

Each is a thin wrapper over a plain function in harness/ (harness.eval.gsm8k, harness.bench.run, harness.gate, the engine's
``LLM``), imported when the command runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from harness.cli.common import (ConfigOpt, DeviceOpt, DraftOpt, DtypeOpt, ModelOpt, OutOpt, PpOpt, PpSpecOpt,
                                ProgressOpt, SetOpt, SpecOpt, TpOpt, check_model, check_out, console, done_line, err, load,
                                overrides, run_dir, save, show, user_errors, write_run_plots)
from harness.core.config import HarnessConfigError
from harness.core.textstream import TextStream

F = "Prompt format"


def _ints(s: str | None, name: str) -> tuple[int, ...] | None:
    """``"1, 8,32"`` -> ``(1, 8, 32)``; HarnessConfigError (one line naming the option ``name``) for an item that is
    not an integer or is empty (``1,,2``, a trailing comma)."""
    if s is None:
        return None
    try:
        return tuple(int(x) for x in s.replace(" ", "").split(","))
    except ValueError:
        raise HarnessConfigError(f"{name}: expected comma-separated integers, got {s!r}") from None


def _cells(s: str | None) -> list[list[int]] | None:
    """``"8192x1,128x32"`` -> ``[[8192, 1], [128, 32]]`` (input_len x batch_size); an empty item is refused."""
    if s is None:
        return None
    out = []
    for part in s.replace(" ", "").split(","):
        a, x, b = part.lower().partition("x")
        if not x or not a.isdigit() or not b.isdigit():
            raise HarnessConfigError(f"--cells: expected INPUTxBATCH[,INPUTxBATCH...] (e.g. 8192x1,128x32), got {s!r}")
        out.append([int(a), int(b)])
    return out


def gsm8k(config: ConfigOpt = None, model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None, pp: PpOpt = None,
          dtype: DtypeOpt = None, device: DeviceOpt = None, spec: SpecOpt = None, pp_spec: PpSpecOpt = None,
          limit: Annotated[Optional[int], typer.Option(help="First N test questions (default 200).")] = None,
          runs: Annotated[Optional[int], typer.Option(help="Repeat the eval, varying arrival order and seed.")] = None,
          num_fewshot: Annotated[Optional[int], typer.Option(help="Shots per prompt (default: the format's).", rich_help_panel=F)] = None,
          max_new_tokens: Annotated[Optional[int], typer.Option(help="max_gen_toks (default: the format's).", rich_help_panel=F)] = None,
          format_: Annotated[Optional[str], typer.Option("--format", help="Prompt format: [cyan]plain-8shot[/cyan] (lm-eval gsm8k, plain text), [cyan]chat-8shot[/cyan] (the model's chat template, shots as turns), [cyan]chat-cot-zeroshot[/cyan] (lm-eval gsm8k_cot_zeroshot), [cyan]chat-cot-llama[/cyan].", rich_help_panel=F)] = None,
          chat_template: Annotated[Optional[bool], typer.Option("--chat-template/--no-chat-template", help="Render prompts with the model's chat template (lm-eval's apply_chat_template).", rich_help_panel=F)] = None,
          fewshot_as_multiturn: Annotated[Optional[bool], typer.Option("--multiturn/--no-multiturn", help="Shots as user/assistant turns: lm-eval's fewshot_as_multiturn (chat template only).", rich_help_panel=F)] = None,
          system_instruction: Annotated[Optional[str], typer.Option(help="lm-eval's system instruction (a system message under the chat template).", rich_help_panel=F)] = None,
          max_concurrency: Annotated[Optional[int], typer.Option(help="Requests running at once.")] = None,
          resume: Annotated[bool, typer.Option("--resume", help="Finish the interrupted run in --out (same command): questions already in its records.jsonl are not asked again; an --out without records starts a fresh run (one line says so).")] = False,
          set_: SetOpt = None, out: OutOpt = None, progress: ProgressOpt = True) -> None:
    """GSM8K scored exactly as lm-eval's gsm8k tasks (strict-match, flexible-extract), greedy, in a prompt format.

    [cyan]--format[/cyan] picks lm-eval's task, shots and whether prompts go through the model's chat template; the
    summary records it, and compare flags results of different formats.

    Records are written as the questions finish (in batches of the engine's concurrency), so an interrupted run
    keeps them; [cyan]--resume[/cyan] with the same command and --out finishes it.
    A request the engine fails (finish_reason "error"; the engine keeps serving the others) is scored as a wrong
    answer: the summary counts the failed requests per run with the first reason, and one warning line says so."""
    from harness.eval.gsm8k import run_gsm8k
    from harness.eval.journal import RECORDS, has_records
    from harness.eval.table import failure_line, render
    with user_errors():
        if resume and out is None:
            raise HarnessConfigError("--resume needs --out: the directory of the run to finish")
        if resume and (Path(out) / "summary.json").is_file():
            raise HarnessConfigError(f"--out {out} holds a finished run (summary.json): nothing to resume; "
                                     f"its results are in {Path(out) / 'summary.md'}")
        check_out(out)
        cfg = load(config, overrides(model, draft, tp, pp, dtype, device, spec, pp_spec, set_, gsm8k=dict(
            limit=limit, runs=runs, num_fewshot=num_fewshot, max_new_tokens=max_new_tokens, max_concurrency=max_concurrency,
            format=format_, chat_template=chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
            system_instruction=system_instruction)))
        check_model(cfg.engine.model)
        from harness.eval.gsm8k import check_gsm8k
        check_gsm8k(cfg)                              # before the run directory is named
        d = run_dir(cfg, "gsm8k", out)
        if resume and not has_records(d):
            err.print(f"--resume: {d} holds no earlier records ({RECORDS}): nothing to resume, starting a fresh run",
                      markup=False, highlight=False)
        if out is None:              # records are written batch by batch: say where, so a stopped run can resume
            err.print(f"run directory: {d} (a stopped run finishes with --out {d} --resume)", markup=False,
                      highlight=False)
        from harness.bench.progress import gsm8k_total, job_progress
        with job_progress(progress, gsm8k_total(cfg), err) as cb:
            summary, records = run_gsm8k(cfg, progress=(lambda r, f, t: cb(f"gsm8k run {r + 1}/{cfg.gsm8k.runs}", f, t)) if cb else None,
                                         run_dir=d, resume=resume)
        rend, md = render(summary, f"GSM8K {cfg.name}")
        save(cfg, "gsm8k", summary, records, md, d)        # written before the tables: a closed stdout loses nothing
        write_run_plots("gsm8k", summary, d)
        show(rend)
        done_line(d)
        if failure_line(summary):
            err.print(f"Warning: {failure_line(summary)}", markup=False, highlight=False)


def bench(config: ConfigOpt = None, model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None, pp: PpOpt = None,
          dtype: DtypeOpt = None, device: DeviceOpt = None, spec: SpecOpt = None, pp_spec: PpSpecOpt = None,
          batch_sizes: Annotated[Optional[str], typer.Option(help="Concurrency levels, e.g. [cyan]1,8,32[/cyan].")] = None,
          input_lens: Annotated[Optional[str], typer.Option(help="Prompt lengths in tokens, e.g. [cyan]512,2048[/cyan].")] = None,
          output_len: Annotated[Optional[int], typer.Option(help="Output tokens per request (ignore_eos).")] = None,
          num_prompts: Annotated[Optional[int], typer.Option(help="Requests per cell and run (default: batch size).")] = None,
          runs: Annotated[Optional[int], typer.Option(help="Timed repetitions per cell.")] = None,
          warmup: Annotated[Optional[int], typer.Option(help="Warmup generations per cell.")] = None,
          cells: Annotated[Optional[str], typer.Option(help="Explicit cells INPUTxBATCH, e.g. [cyan]8192x1,128x32[/cyan] (replace input lens x batch sizes).")] = None,
          floors: Annotated[Optional[bool], typer.Option("--floors/--no-floors", help="Measure copy bandwidth + matmul rate here; print each figure against its floor.", rich_help_panel="Measured alongside")] = None,
          peer: Annotated[Optional[bool], typer.Option("--peer/--no-peer", help="Also run HF transformers generate on the same model and prompts.", rich_help_panel="Measured alongside")] = None,
          peer_prompt_lookup: Annotated[Optional[bool], typer.Option("--peer-prompt-lookup/--no-peer-prompt-lookup", help="Add HF prompt-lookup speculation (batch-1 cells).", rich_help_panel="Measured alongside")] = None,
          baseline: Annotated[Optional[str], typer.Option(help="[cyan]nospec[/cyan]: also run every cell without speculation (same topology and prompts) and report the speedup.")] = None,
          prompts: Annotated[Optional[str], typer.Option(help="Prompt text: [cyan]gsm8k-test[/cyan] (default, alias [cyan]gsm8k[/cyan]: GSM8K test, held out from the shipped heads' training, cut to the input length), [cyan]gsm8k-train[/cyan] (the heads' training text) or a natural set, e.g. [cyan]specbench[/cyan] (chat, coding, summarisation, reasoning...; acceptance per category).")] = None,
          request_rate: Annotated[Optional[list[str]], typer.Option(help="Open loop: Poisson arrivals at this many requests/s ([cyan]inf[/cyan]: all at once); repeat for one row per rate.", rich_help_panel="Open loop")] = None,
          max_concurrency: Annotated[Optional[int], typer.Option(help="Open loop: requests in flight at most.", rich_help_panel="Open loop")] = None,
          slo: Annotated[Optional[str], typer.Option(help="Open loop goodput SLOs in ms, e.g. [cyan]ttft=2000,tpot=200[/cyan].", rich_help_panel="Open loop")] = None,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="List the cells (and which would fail) and exit; loads no model.")] = False,
          set_: SetOpt = None, out: OutOpt = None, progress: ProgressOpt = True) -> None:
    """TTFT, TPOT, ITL, E2E and output tok/s per batch size x input length (GSM8K test-text prompts by default, or a natural
    prompt set with [cyan]--prompts[/cyan]); [cyan]--dry-run[/cyan] lists the cells and runs nothing.
    With [cyan]--request-rate[/cyan] (open loop): Poisson arrivals, latency percentiles, req/s and goodput per rate.
    Interrupted (Ctrl-C, SIGTERM), it writes the cells that finished, marked as interrupted, before it exits."""
    from harness.bench.run import run_bench
    from harness.bench.table import render
    from harness.bench.openloop import parse_rate, parse_slo
    with user_errors():
        check_out(out)
        rates = tuple(parse_rate(r) for r in request_rate) if request_rate else None
        slos = parse_slo(slo) or {}
        if slos and not rates:
            raise HarnessConfigError("--slo sets goodput bounds of an open-loop run: give --request-rate too")
        cfg = load(config, overrides(model, draft, tp, pp, dtype, device, spec, pp_spec, set_, bench=dict(
            batch_sizes=_ints(batch_sizes, "--batch-sizes"), input_lens=_ints(input_lens, "--input-lens"),
            output_len=output_len, num_prompts=num_prompts, runs=runs, warmup=warmup, cells=_cells(cells),
            floors=floors, peer=peer, peer_prompt_lookup=peer_prompt_lookup, baseline=baseline, prompts=prompts,
            request_rates=list(rates) if rates else None, max_concurrency=max_concurrency,
            slo_ttft_ms=slos.get("ttft"), slo_tpot_ms=slos.get("tpot"))))
        if cfg.bench.request_rates:
            from harness.bench.openloop import check_open_loop
            check_open_loop(cfg)
        if dry_run:
            from harness.bench.dryrun import bench_cells, topology_warning
            lines, bad = bench_cells(cfg)
            warning = topology_warning(cfg)
            if warning:
                err.print(warning, markup=False, highlight=False)
            for line in lines:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            if bad:
                console.print(f"{bad} cell(s) would fail", markup=False, highlight=False)
                raise typer.Exit(1)
            return
        check_model(cfg.engine.model)
        d = run_dir(cfg, "bench", out)
        from harness.bench.progress import bench_total, job_progress
        title = f"bench {cfg.name}" + (f" [{cfg.label}]" if cfg.label else "")
        try:
            with job_progress(progress, bench_total(cfg), err) as cb:
                summary, records = run_bench(cfg, progress=cb)
        except BaseException as e:      # an interrupt: the cells that finished are written, then it goes on
            partial = getattr(e, "partial_bench", None)
            if partial is not None:
                cut = partial[0]["interrupted"]
                save(cfg, "bench", *partial, render(partial[0], f"{title} (interrupted after {cut['cells_done']} of "
                                                              f"{cut['cells_total']} cells)")[1], d)
                err.print(f"partial results ({cut['cells_done']} of {cut['cells_total']} cells): {d}", markup=False,
                          highlight=False)
            raise
        rend, md = render(summary, title)
        save(cfg, "bench", summary, records, md, d)        # written before the tables: a closed stdout loses nothing
        write_run_plots("bench", summary, d)
        show(rend)
        done_line(d)
        for f in summary.get("failed_cells", []):         # the measured cells are kept; the command fails
            err.print(f"Error: {f['error']}", markup=False, highlight=False)
        if summary.get("failed_cells"):
            raise typer.Exit(1)


def gate(config: ConfigOpt = "gate", model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None,
         dtype: DtypeOpt = None, device: DeviceOpt = None,
         limit: Annotated[Optional[int], typer.Option(help="GSM8K questions in the slice.")] = None,
         accuracy_margin: Annotated[Optional[float], typer.Option(help="Allowed accuracy drop (0-1).")] = None,
         accept_length_margin: Annotated[Optional[float], typer.Option(help="Allowed accept-length drop.")] = None,
         set_: SetOpt = None, out: OutOpt = None, progress: ProgressOpt = True) -> None:
    """Parity gate: PP1+spec vs PP2+spec on one GSM8K slice; [bold]exit 1[/bold] when accuracy or accept length drops,
    or when the engine failed any request on either side (finish_reason "error")."""
    from harness.gate import render, run_gate
    with user_errors():
        check_out(out)
        cfg = load(config, overrides(model, draft, tp, None, dtype, device, None, None, set_, gate=dict(
            limit=limit, accuracy_margin=accuracy_margin, accept_length_margin=accept_length_margin)))
        check_model(cfg.engine.model)
        d = run_dir(cfg, "gate", out)
        from harness.bench.progress import gsm8k_total, job_progress
        with job_progress(progress, gsm8k_total(cfg, 2, cfg.gate.limit, 1), err) as cb:
            summary, records = run_gate(cfg, progress=cb)
        rend, md = render(summary, "parity gate" + ("" if cfg.name == "gate" else f" ({cfg.name})"))
        save(cfg, "gate", summary, records, md, d)        # written before the tables: a closed stdout loses nothing
        show(rend)
        done_line(d)
    if not summary["verdict"]["passed"]:
        raise typer.Exit(1)


def generate(prompt: Annotated[str, typer.Argument(help="Prompt text.")], config: ConfigOpt = None,
             model: ModelOpt = None, draft: DraftOpt = None, tp: TpOpt = None, pp: PpOpt = None,
             dtype: DtypeOpt = None, device: DeviceOpt = None, spec: SpecOpt = None, pp_spec: PpSpecOpt = None,
             max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 128,
             temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
             set_: SetOpt = None) -> None:
    """Print the completion of one prompt, e.g. [cyan]ppspec generate 'Hi' --pp 2 --pp-spec[/cyan]."""
    with user_errors():
        if not prompt:                               # refused before the model loads (the engine says the same)
            raise HarnessConfigError("the prompt is empty")
        from engine import LLM, SamplingParams
        cfg = load(config, overrides(model, draft, tp, pp, dtype, device, spec, pp_spec, set_))
        check_model(cfg.engine.model)
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        fit = check_prompt(cfg.engine, prompt)
        if fit is not None and max_new_tokens > fit[1] - fit[0]:
            # served, not refused (asking for "as many as fit" is legitimate; EOS usually ends it sooner), but said
            # before the model loads, and the request carries the cap so the engine's own clamp notice is not repeated
            room = fit[1] - fit[0]
            err.print(f"Note: --max-new-tokens {max_new_tokens} is capped at {room} tokens: the context length "
                      f"{fit[1]} minus the prompt's {fit[0]}", markup=False, highlight=False)
            params = SamplingParams(temperature=temperature, max_new_tokens=room)
        with LLM(cfg.engine) as llm:
            out = TextStream(llm.tokenizer)          # tokens printed as they are committed, as plain text
            try:
                o = llm.generate([prompt], params, stream=out.on_tokens)[0]
            except BaseException:                    # an interrupt mid-stream: the shell's prompt on its own line
                out.end_line()
                raise
        if o.finish_reason == "error":
            out.end_line()
            err.print(f"Error: the request failed inside the engine: {o.error}", markup=False, highlight=False)
            raise typer.Exit(1)
        out.close(o.text)               # the completion exactly: no console wrapping, markup or emoji codes
        spec_on = cfg.engine.spec.enabled and o.accept_lengths       # plain decoding records 1 per step: not shown
        acc = f", accept length {sum(o.accept_lengths) / len(o.accept_lengths):.2f}" if spec_on else ""
        cut = (", stopped by the context length" if o.finish_reason == "length" and len(o.token_ids) < max_new_tokens
               else "")
        err.print(f"[{len(o.token_ids)} tokens, {o.finish_reason}{cut}{acc}]", markup=False, highlight=False)


def check_prompt(engine_config, prompt: str) -> tuple[int, int] | None:
    """Refuse a text prompt that is not valid Unicode, empty or over-long with the engine's own checks, from the
    tokenizer and the model's config alone (before any weight is loaded or rank started); returns (prompt tokens,
    context length in tokens). Random weights (no tokenizer): no check, None.

    Raises:
        ConfigError: one line about "the prompt" (the engine's messages name a prompt by its index in a call of
            several; ``generate`` has one).
    """
    if engine_config.load_format == "dummy":
        return None
    from engine.config import ConfigError
    from engine.model.loader import load_model_config, load_tokenizer, resolve_model_path
    from engine.requests import prompt_length_error, prompt_token_ids
    path = resolve_model_path(engine_config.model)
    mc, tok = load_model_config(path), load_tokenizer(path)
    try:
        ids = prompt_token_ids(0, prompt, mc.vocab_size, lambda s: tok.encode(s, add_special_tokens=False))
    except ConfigError as e:
        raise ConfigError("the prompt: " + str(e).removeprefix("prompt 0: ")) from None
    ctx = engine_config.context_length(mc)
    if not ids:
        raise ConfigError("the prompt is empty (no tokens)")
    why = prompt_length_error(len(ids), ctx)
    if why:
        raise ConfigError(f"the {why}")
    return len(ids), ctx
