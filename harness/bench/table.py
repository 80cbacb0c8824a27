"""``ppspec bench`` tables: a bench summary (harness/bench/run.py) as a rich table and markdown, latencies in ms.

With ``floors`` a figure reads ``measured / floor (ratio x)``; with ``peer`` every peer variant adds rows; an
open-loop summary is rendered by harness/bench/openloop.py.
"""
from __future__ import annotations

from harness.bench import openloop, pp_metrics, prompt_sets
from harness.core import stats
from harness.bench.cells import RANDOM_WEIGHTS
from harness.core.tables import both, fmt, rich_table


def _ms(x: float | None) -> str:
    """Seconds -> milliseconds with 3 significant digits (floors are often well under 1 ms)."""
    if x is None:
        return "-"
    v = x * 1e3
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.2f}"


def vs(measured: float | None, bound: float | None, kind: str = "ms") -> str:
    """``measured / bound (ratio x)``, ratio = measured / bound (``ms``: seconds shown in ms; ``tps``: tok/s)."""
    f = _ms if kind == "ms" else _tps
    if measured is None:
        return "-"
    if not bound:
        return f(measured)
    return f"{f(measured)} / {f(bound)} ({measured / bound:.3g}x)"


def render(summary: dict, title: str = "bench") -> tuple[list, str]:
    """Rich table + markdown: one row per (input_len, batch_size); latencies in ms. The title names the summary's
    prompt source (``[prompts gsm8k-test]``).

    With ``floors`` TTFT mean, TPOT mean/p50 and tok/s read ``measured / floor (ratio x)``; with
    ``peer`` every peer variant adds a row per cell (markdown) or rows per metric (terminal).
    """
    src = summary.get("prompt_source")
    if src and f"prompts {src}" not in title:
        title = f"{title} [prompts {src}]"
    if summary.get("open_loop"):
        return openloop.render(summary, f"{title} (open loop)")
    floors = {(f["input_len"], f["batch_size"]): f for f in (summary.get("floors") or {}).get("cells", [])}
    peer = summary.get("peer")
    random_weights = summary.get("weights") == RANDOM_WEIGHTS or (peer or {}).get("weights") == RANDOM_WEIGHTS
    if random_weights and RANDOM_WEIGHTS not in title.lower():
        title = f"{title} [{RANDOM_WEIGHTS}]"
    headers = ["input", "batch", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "TPOT mean ms", "TPOT p50 ms",
               "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E mean s", "tok/s", "accept len"]
    rows = []
    spec_on = bool(((summary.get("engine_info") or {}).get("spec") or {}).get("algorithm"))
    for c in summary["cells"]:
        p = c["pooled"]
        tps = p["output_throughput_runs"]
        tp = sum(tps) / len(tps) if tps else None
        fl = floors.get((c["input_len"], c["batch_size"]))
        if fl:
            ttft_mean, tpot_mean = vs(p["ttft"]["mean"], fl["ttft_mean_floor_s"]), vs(p["tpot"]["mean"], fl["tpot_floor_s"])
            tpot_p50, tok = vs(p["tpot"]["median"], fl["tpot_floor_s"]), vs(tp, fl["output_throughput_ceiling"], "tps")
        else:
            ttft_mean, tpot_mean = fmt(p["ttft"]["mean"], "ms"), fmt(p["tpot"]["mean"], "ms")
            tpot_p50 = fmt(p["tpot"]["median"], "ms")
            tok = fmt(tp) if tps else "-"
        rows.append([str(c["input_len"]), str(c["batch_size"]),
                     ttft_mean, fmt(p["ttft"]["median"], "ms"), fmt(p["ttft"]["p99"], "ms"),
                     tpot_mean, tpot_p50, fmt(p["tpot"]["p99"], "ms"),
                     fmt(p["itl"]["median"], "ms"), fmt(p["itl"]["p99"], "ms"), fmt(p["e2e"]["mean"]),
                     tok, fmt(p["accept_length"]["mean"]) if spec_on else "-"])   # plain decoding: 1 a step
    info = summary.get("engine_info", {})
    notes = [f"output {summary['bench']['output_len']} tokens, ignore_eos, "
             f"{summary['bench']['runs']} run(s) after {summary['bench']['warmup']} warmup; "
             f"KV pool {fmt(info.get('kv_pool_tokens'), 'int')} tokens; "
             f"peak memory {fmt(info.get('peak_memory_bytes'), 'gib')} GiB; weights {fmt(info.get('weight_bytes'), 'gib')} GiB; "
             f"prompts: {summary.get('prompt_source')}"]
    notes += [f"NOT MEASURED: {f['error']}" for f in summary.get("failed_cells", [])]
    for c in summary["cells"]:
        acc = c["pooled"].get("accept_length") or {}
        if acc.get("per_position"):
            notes.append(f"acceptance, input {c['input_len']} batch {c['batch_size']}: accept length "
                         f"{stats.accept_detail(acc)} ("
                         + ("95% bootstrap CI over requests; " if acc.get("ci95") else "")
                         + "per position: share of "
                         "rounds accepting at least that many drafted tokens); tokens per round "
                         + ", ".join(f"{k}: {v}" for k, v in acc["hist"].items()))
    for c in summary["cells"]:
        if c["pooled"].get("adaptive"):
            notes.append(f"adaptive speculation, input {c['input_len']} batch {c['batch_size']}: verify rounds "
                         f"(per request) by tier, shape: {stats.shape_detail(c['pooled']['adaptive'])}")
    cat_rend, cat_md = ([], "")
    if summary.get("accept_by_category"):
        cat_rend, cat_md = prompt_sets.render_categories(summary["accept_by_category"],
                                             f"acceptance by category ({summary.get('prompt_source')}, all cells)")
    for c in (summary.get("baseline") or {}).get("cells", []):
        ci_t, ci_p = c["tok_s_ratio_ci95"], c["tpot_ratio_ci95"]
        ci_t = [f"{x:.2f}" for x in ci_t] if ci_t else None
        ci_p = [f"{x:.2f}" for x in ci_p] if ci_p else None
        n_t = None if ci_t else 1
        n_p = None if ci_p else 1
        notes.append(f"speedup over no-spec (same topology and prompts), input {c['input_len']} batch "
                     f"{c['batch_size']}: tok/s " + stats.with_ci(f"x{c['tok_s_ratio']:.2f}", ci_t, n_t)
                     + f" (no-spec {fmt(c['nospec_output_throughput'])} tok/s), TPOT "
                     + (stats.with_ci(f"x{c['tpot_ratio']:.2f}", ci_p, n_p) + " (no-spec "
                        f"{fmt(c['nospec_tpot_mean'], 'ms')} ms)" if c["tpot_ratio"] is not None else "-"))
    notes += pp_metrics.notes(summary)
    if random_weights:
        notes.append(f"{RANDOM_WEIGHTS.upper()} (load_format: dummy): latency, throughput and memory are real; "
                     "accuracy, accept length and peer agreement are not")
    if summary.get("floors"):
        f = summary["floors"]
        notes.append(f"floors (measured here, {f['device']}): copy bandwidth {f['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
                     f"(read+write), {f['matmul_dtype']} matmul {f['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s; "
                     f"weights {f['weight_bytes_per_forward'] / 2**30:.3g} GiB per forward ({f['weight_dtype']}); "
                     "cells read measured / floor (ratio x): TTFT mean vs the mean floor of the cell's prompts "
                     "arriving together, TPOT vs max(bytes/bandwidth, FLOPs/rate) at the mean decode context, "
                     "tok/s vs batch / TPOT floor (ratio < 1); plain-decoding floors (speculation can beat TPOT's)")
    peer_rows, peer_names = [], []
    if peer is not None:
        if peer.get("error"):
            notes.append(f"peer failed: {peer['error']}")
        else:
            notes.append(f"peer: transformers {peer.get('transformers')} generate, {peer.get('dtype')} on {peer.get('device')}, "
                         f"{peer.get('attn_implementation')} attention, default cache, greedy, exactly "
                         f"{peer.get('output_len')} new tokens, batch = the cell's first B prompts in one call; "
                         f"TTFT = generate(max_new_tokens=1) for the whole batch (floor: all B prefills), "
                         f"TPOT = (E2E - TTFT) / (output - 1); weights: {peer.get('weights')} ({peer.get('source')})")
        for r in peer.get("cells", []):
            fl = floors.get((r["input_len"], r["batch_size"]))
            if r["name"] not in peer_names:
                peer_names.append(r["name"])
            if r.get("error"):
                notes.append(f"peer {r['name']} in={r['input_len']} bs={r['batch_size']} failed: {r['error']}")
                cellv = {"ttft": "failed", "tpot": "failed", "tps": "failed", "e2e": "-", "match": "-"}
            else:
                cellv = {"ttft": vs(r["ttft_s"], fl["ttft_batch_floor_s"]) if fl else _ms(r["ttft_s"]),
                         "tpot": vs(r["tpot_s"], fl["tpot_floor_s"]) if fl else _ms(r["tpot_s"]),
                         "tps": vs(r["output_throughput"], fl["output_throughput_ceiling"], "tps") if fl
                         else _tps(r["output_throughput"]),
                         "e2e": fmt(r["e2e_s"]), "match": fmt(r.get("greedy_prefix_match"), "pct")}
            peer_rows.append((r, cellv))
    md_headers, md_rows = headers, rows
    if peer_rows:
        md_headers = ["system", *headers]
        md_rows = [["ppspec", *r] for r in rows]
        for r, v in peer_rows:
            md_rows.append([r["name"], str(r["input_len"]), str(r["batch_size"]), v["ttft"], "-", "-", v["tpot"],
                            "-", "-", "-", "-", v["e2e"], v["tps"], "-"])
        if any(r.get("greedy_prefix_match") is not None for r, _ in peer_rows):
            notes.append("peer greedy agreement with ppspec (mean common-prefix share of the output): " + ", ".join(
                f"{r['name']} in={r['input_len']} bs={r['batch_size']}: {v['match']}" for r, v in peer_rows
                if r.get("greedy_prefix_match") is not None))
    _, md = both(title, md_headers, md_rows)
    keys = [(c["input_len"], c["batch_size"]) for c in summary["cells"]]
    cols = [f"in {L} bs {B}" for L, B in keys]                       # terminal: one column per cell
    trows = [[h, *(r[i] for r in rows)] for i, h in enumerate(headers) if i > 1]
    for name in peer_names:
        by_cell = {(r["input_len"], r["batch_size"]): v for r, v in peer_rows if r["name"] == name}
        for metric, key in (("TTFT ms", "ttft"), ("TPOT ms", "tpot"), ("tok/s", "tps")):
            trows.append([f"{name} {metric}", *(by_cell[k][key] if k in by_cell else "-" for k in keys)])
    t = rich_table(title, ["metric", *cols], trows)
    return [t, *cat_rend, *notes], md + (f"\n{cat_md}" if cat_md else "") + "\n" + "\n\n".join(notes) + "\n"
