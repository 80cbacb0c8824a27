"""``ppspec gate``: the accept-length parity gate (CI).

Runs the same GSM8K slice under the baseline PP size and the candidate PP size, both with
speculative decoding, and fails when the candidate's accuracy (either filter) drops by more than
``accuracy_margin``, when it loses paired questions at exact McNemar p < ``mcnemar_alpha``, or when its mean accept
length drops by more than ``accept_length_margin``. Accuracy alone cannot catch a lost tree (the bonus token keeps
the text right: acceptance collapses); acceptance alone cannot catch corrupted tokens (``over_accept``: the text
departs, acceptance holds). In float32 on CPU PP parity is exact, so there any differing output fails too.
It also fails when the engine failed any request on either side (finish_reason "error"): a failed request is an
engine fault whatever the margins, and scoring it as a wrong answer could hide it inside the accuracy margin.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

from harness.core import stats
from harness.core.config import HarnessConfigError, RunConfig
from harness.eval.gsm8k import run_gsm8k
from harness.eval.task import FILTERS
from harness.core.tables import both, fmt


def gate_configs(cfg: RunConfig) -> tuple[RunConfig, RunConfig]:
    """(baseline, candidate) run configs: one run on ``gate.limit`` questions, PP sizes from ``gate``.

    A fault (``PPSPEC_FAULT`` / ``fault:``) is injected into the candidate only: it simulates a broken
    PP relay, and the baseline stays the clean reference.

    Raises:
        HarnessConfigError: speculative decoding is off (nothing to gate).
        engine.config.ConfigError: the engine refuses the candidate (e.g. PP x spec not enabled) or either
            topology (tp / pp cannot split the model).
    """
    if not cfg.engine.spec.enabled:
        raise HarnessConfigError("gate: speculative decoding is off (is the draft missing?); the gate compares "
                                 "PP runs with spec")
    g = cfg.gate
    work = dataclasses.replace(cfg.gsm8k, limit=g.limit, runs=1)
    base = dataclasses.replace(cfg, gsm8k=work, engine=cfg.engine.replace(pp=g.baseline_pp, fault=None))
    cand = dataclasses.replace(cfg, gsm8k=work, engine=cfg.engine.replace(pp=g.candidate_pp))
    # both topologies are checked before the baseline runs (a refused candidate must not waste the baseline's run)
    from harness.bench.dryrun import check_topology
    for c in (base, cand):
        check_topology(c)
    return base, cand


@contextlib.contextmanager
def _env_without(name: str | None) -> Iterator[None]:
    from engine import knobs
    saved = os.environ.get(name) if name else None
    if saved is not None:
        knobs.set_env(name, None)
    try:
        yield
    finally:
        if saved is not None:
            knobs.set_env(name, saved)


def exact_parity(engine) -> bool:
    """PP parity is exact for this engine config: float32 on CPU (the same torch reference ops on every stage), so
    any differing greedy output is a fault; on other dtypes and devices near-ties may flip and the margins decide."""
    return engine.dtype == "float32" and str(engine.device).split(":")[0] == "cpu"


def evaluate_gate(base: dict, cand: dict, base_records: list[dict], cand_records: list[dict],
                  accuracy_margin: float, accept_length_margin: float, mcnemar_alpha: float = 0.05,
                  exact: bool = False) -> dict:
    """Compare two gsm8k summaries; returns checks, verdict and the count of differing questions.

    Checks: accuracy per filter within ``accuracy_margin``; the paired accuracy (flexible-extract) on the questions
    both sides answered, failing when the candidate lost more than it won and the exact McNemar p < ``mcnemar_alpha``
    (``baseline`` / ``candidate``: questions only that side got right); accept length within its margin; no failed
    request (``failed_requests`` of run 0) on either side: that check's ``baseline`` / ``candidate`` are the counts,
    its margin 0, and its ``first_error`` the first reason (candidate's first). With ``exact`` (float32 CPU,
    :func:`exact_parity`) also "identical outputs": any question whose response differs fails the gate."""
    checks = []
    for f in FILTERS:
        a, b = base["runs"][0]["accuracy"][f], cand["runs"][0]["accuracy"][f]
        checks.append({"metric": f"accuracy ({f})", "baseline": a, "candidate": b, "delta": b - a,
                       "margin": accuracy_margin, "ok": b >= a - accuracy_margin - 1e-12})
    rb = {r["doc_id"]: r for r in base_records}
    rc = {r["doc_id"]: r for r in cand_records}
    common = sorted(set(rb) & set(rc))
    differ = [q for q in common if rb[q]["response"] != rc[q]["response"]]
    mc = stats.mcnemar_exact([rb[q]["flexible-extract"]["exact_match"] for q in common],
                             [rc[q]["flexible-extract"]["exact_match"] for q in common])
    checks.append({"metric": "paired accuracy (McNemar)", "baseline": mc["n10"], "candidate": mc["n01"],
                   "delta": mc["p_value"], "margin": mcnemar_alpha,
                   "ok": not (mc["n10"] > mc["n01"] and mc["p_value"] < mcnemar_alpha)})
    a, b = base["runs"][0]["accept_length"]["mean"], cand["runs"][0]["accept_length"]["mean"]
    ok = a is not None and b is not None and b >= a - accept_length_margin - 1e-12
    checks.append({"metric": "accept length", "baseline": a, "candidate": b,
                   "delta": (b - a) if a is not None and b is not None else None,
                   "margin": accept_length_margin, "ok": ok})
    fb, fc = (s["runs"][0].get("failed_requests", 0) for s in (base, cand))
    first = next((s["runs"][0].get("first_error") for s in (cand, base) if s["runs"][0].get("first_error")), None)
    checks.append({"metric": "failed requests", "baseline": fb, "candidate": fc, "delta": fc - fb, "margin": 0,
                   "ok": fb == 0 and fc == 0, "first_error": first})
    if exact:
        checks.append({"metric": "identical outputs", "baseline": len(common), "candidate": len(common) - len(differ),
                       "delta": -len(differ), "margin": 0, "ok": not differ, "n": len(common)})
    failed = [c["metric"] for c in checks if not c["ok"]]
    return {"passed": not failed, "failed": failed, "checks": checks, "n_questions": len(common),
            "differing_outputs": len(differ), "differing_doc_ids": differ, "mcnemar_flexible": mc, "exact": exact}


def run_gate(cfg: RunConfig, progress: Callable[[str, int, int], None] | None = None) -> tuple[dict, list[dict]]:
    """Run baseline then candidate; returns (summary with ``verdict``, records tagged by ``side``; each side's
    summary carries the execution plan it ran, ``plan``)."""
    from engine.plan import resolve_plan
    base_cfg, cand_cfg = gate_configs(cfg)
    out, records = {}, []
    for side, c in (("baseline", base_cfg), ("candidate", cand_cfg)):
        cb = (lambda r, f, t, s=f"{side} pp={c.engine.pp}": progress(s, f, t)) if progress else None
        with _env_without("PPSPEC_FAULT" if side == "baseline" else None):   # the engine re-reads it
            summary, recs = run_gsm8k(c, progress=cb)
        summary["plan"] = resolve_plan(c.engine).as_dict()     # each side's own plan (meta.plan is the suite's)
        out[side] = {"summary": summary, "records": recs, "pp": c.engine.pp}
        records.extend({"side": side, "pp": c.engine.pp, **r} for r in recs)
    verdict = evaluate_gate(out["baseline"]["summary"], out["candidate"]["summary"], out["baseline"]["records"],
                            out["candidate"]["records"], cfg.gate.accuracy_margin, cfg.gate.accept_length_margin,
                            cfg.gate.mcnemar_alpha, exact_parity(cfg.engine))
    return {"kind": "gate", "fault": cfg.engine.fault, "gate": dataclasses.asdict(cfg.gate), "verdict": verdict,
            "baseline": out["baseline"]["summary"], "candidate": out["candidate"]["summary"]}, records


def render(summary: dict, title: str = "gate") -> tuple[list, str]:
    """Rich table + markdown of the gate checks, and the verdict line with its reason."""
    v, g = summary["verdict"], summary["gate"]
    headers = ["metric", f"baseline PP{g['baseline_pp']}", f"candidate PP{g['candidate_pp']}", "delta",
               "allowed drop", "result"]
    rows = []
    for c in v["checks"]:
        if c["metric"] == "paired accuracy (McNemar)":
            cells = [f"{c['baseline']} only right", f"{c['candidate']} only right", f"p={c['delta']:.3g}",
                     f"p >= {c['margin']:g} if worse"]
        elif c["metric"] == "identical outputs":
            cells = [f"{c['baseline']} questions", f"{c['candidate']} identical", fmt(c["delta"], "int"), "0"]
        else:
            kind = "pct" if c["metric"].startswith("accuracy") else "int" if c["metric"] == "failed requests" else "num"
            cells = [fmt(c[k], kind) for k in ("baseline", "candidate", "delta", "margin")]
        rows.append([c["metric"], *cells, "ok" if c["ok"] else "FAIL"])
    t, md = both(f"{title}: {v['n_questions']} GSM8K questions, spec on both sides"
                 + (f", fault={summary['fault']} (candidate only)" if summary.get("fault") else ""), headers, rows)
    mc = v["mcnemar_flexible"]
    line = (f"questions with different output: {v['differing_outputs']} of {v['n_questions']}"
            + (" (float32 CPU: PP parity is exact, any difference fails)" if v.get("exact") else
               " (not float32 CPU: near-ties may flip, the margins decide)")
            + f"; McNemar (flexible-extract) discordant {mc['discordant']}, p={mc['p_value']:.3g}")
    failing = sorted((c for c in v["checks"] if not c["ok"]), key=lambda c: c["metric"] != "failed requests")
    verdict = "PASS" if v["passed"] else "FAIL: " + "; ".join(_why(c) for c in failing)   # failed requests first
    return [t, line, verdict], f"{md}\n{line}\n\n**{verdict}**\n"


def _why(c: dict) -> str:
    """Why one gate check failed, for the verdict line."""
    if c["metric"] == "failed requests":
        return (f"requests failed inside the engine: baseline {c['baseline']}, candidate {c['candidate']} "
                f"(first: {c.get('first_error')})")
    if c["metric"] == "identical outputs":
        return f"float32 CPU: PP parity is exact; {-c['delta']} of {c['n']} questions differ"
    if c["metric"] == "paired accuracy (McNemar)":
        return (f"paired accuracy (flexible-extract): the candidate lost {c['baseline']} questions and won "
                f"{c['candidate']} (exact McNemar p={c['delta']:.3g} < {c['margin']:g})")
    return (f"{c['metric']} dropped {abs(c['delta']) if c['delta'] is not None else float('nan'):.3g} "
            f"(allowed {c['margin']:.3g})")
