"""CPU thread choice (``engine.plan.cpu_threads``): the cores free of load, shared by the ranks, at least 1 each;
stated in the execution plan."""
from __future__ import annotations

from engine import EngineConfig
from engine.plan import cpu_threads, resolve_plan


def test_idle_cores_are_shared_by_the_ranks():
    assert cpu_threads(1, cores=2, load=0.1) == {"per_rank": 2, "cores": 2, "load": 0.1, "contended": False}
    assert cpu_threads(2, cores=8, load=0.0)["per_rank"] == 4
    assert cpu_threads(3, cores=2, load=0.0)["per_rank"] == 1


def test_a_loaded_machine_gets_fewer_threads_down_to_one():
    assert cpu_threads(1, cores=2, load=1.0) == {"per_rank": 1, "cores": 2, "load": 1.0, "contended": True}
    assert cpu_threads(1, cores=2, load=7.5)["per_rank"] == 1
    assert cpu_threads(1, cores=16, load=4.2)["per_rank"] == 12
    assert cpu_threads(2, cores=16, load=4.2)["per_rank"] == 6


def test_the_plan_states_the_threads(tiny_model_dir):
    plan = resolve_plan(EngineConfig(model=str(tiny_model_dir), device="cpu", pp=2))
    assert plan.threads["per_rank"] >= 1 and plan.threads["cores"] >= 1
    assert f"cpu threads {plan.threads['per_rank']} per rank" in plan.describe()
    assert resolve_plan(EngineConfig(model=str(tiny_model_dir)), device="cuda").threads is None
