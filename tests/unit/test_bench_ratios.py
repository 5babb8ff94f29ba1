# SPDX-License-Identifier: Apache-2.0
"""The benchmark's ratio arithmetic and run order: per-round ratios against
the same round's baseline, their median, their geometric mean with its
standard error, and orders balanced by slot and by predecessor."""

import json
import math
import os
import statistics
from collections import Counter
from types import SimpleNamespace

import pytest

from benchmarks.common import (
    Comparison,
    StepRun,
    alternate,
    balanced_orders,
    in_process_engines,
    interleave_steps,
)


def comparison(baseline: list[float], variant: list[float]) -> Comparison:
    comp = Comparison("c", "tok/s", baseline="plain")
    for b, v in zip(baseline, variant):
        comp.add("plain", b)
        comp.add("asks", v)
    return comp


def test_ratios_pair_each_round_with_its_own_baseline():
    comp = comparison([100.0, 200.0, 400.0], [90.0, 190.0, 400.0])
    assert comp.round_ratios("asks") == [0.9, 0.95, 1.0]
    assert comp.ratio("asks") == 0.95


def test_geometric_mean_ratio_carries_the_standard_error_of_the_rounds():
    ratios = [0.9, 0.95, 1.0, 1.05]
    comp = comparison([100.0] * 4, [100.0 * r for r in ratios])
    geomean, stderr = comp.ratio_geomean("asks")
    logs = [math.log(r) for r in ratios]
    assert geomean == pytest.approx(math.exp(statistics.fmean(logs)))
    assert stderr == pytest.approx(geomean * statistics.stdev(logs) / 2)


def test_identical_engines_read_one_whichever_is_the_baseline():
    # Two runs swapped: the arithmetic mean of the ratios reads (2 + 0.5) / 2
    # = 1.25 both ways; the geometric mean reads 1.
    comp = comparison([100.0, 200.0], [200.0, 100.0])
    assert comp.ratio_geomean("asks")[0] == pytest.approx(1.0)


def test_one_round_has_no_standard_error():
    assert comparison([100.0], [97.0]).ratio_geomean("asks") == (pytest.approx(0.97), 0.0)


def test_summary_reports_geometric_mean_and_standard_error_beside_the_median():
    comp = comparison([100.0, 100.0], [96.0, 98.0])
    comp.targets["asks"] = 0.97
    entry = comp.summary()["variants"]["asks"]
    assert entry["ratio"] == pytest.approx(0.97)
    assert entry["ratio_geomean"] == pytest.approx(math.sqrt(0.96 * 0.98))
    assert entry["ratio_geomean_stderr"] == pytest.approx(0.01, rel=0.01)
    assert entry["meets_target"] is True


@pytest.mark.parametrize("n", range(1, 9))
def test_balanced_orders_put_every_variant_in_every_slot_equally_often(n):
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    for slot in range(n):
        counts = Counter(order[slot] for order in orders)
        assert set(counts) == set(range(n))
        assert len(set(counts.values())) == 1


@pytest.mark.parametrize("n", range(2, 9))
def test_balanced_orders_put_every_variant_after_every_other_equally_often(n):
    pairs = Counter((a, b) for order in balanced_orders(n) for a, b in zip(order, order[1:]))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(pairs.values())) == 1


def test_alternate_runs_each_variant_once_per_round(monkeypatch):
    monkeypatch.setattr("benchmarks.common.SETTLE_S", 0)
    ran: list[str] = []

    def variant(name: str):
        return lambda: ran.append(name) or 1.0

    comp = Comparison("c", "tok/s", baseline="a")
    alternate(comp, {name: variant(name) for name in "abc"}, rounds=6)
    assert all(len(comp.samples[name]) == 6 for name in "abc")
    assert all(sorted(ran[i : i + 3]) == ["a", "b", "c"] for i in range(0, 18, 3))
    assert ran[:3] != ran[3:6]  # the order changes between rounds


class StepEngine:
    """Stands in for ``LLM.llm_engine``: each request needs ``steps`` steps and
    finishes with ``tokens`` tokens (hidden states when ``states``); every
    step is logged in ``log`` under ``name``."""

    def __init__(self, name: str, log: list[str], steps: int, tokens: int, states: bool):
        self.name, self.log, self.steps, self.tokens, self.states = name, log, steps, tokens, states
        self.pending: dict[str, int] = {}

    def add_request(self, request_id: str, prompt: dict, params: object) -> None:
        self.pending[request_id] = self.steps

    def step(self) -> list[SimpleNamespace]:
        self.log.append(self.name)
        done = []
        for rid in list(self.pending):
            self.pending[rid] -= 1
            if not self.pending[rid]:
                del self.pending[rid]
                out = SimpleNamespace(token_ids=[0] * self.tokens, hidden_states=self.states)
                done.append(SimpleNamespace(request_id=rid, finished=True, outputs=[out]))
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)


def step_run(name: str, log: list[str], steps: int, states: bool = True, asks: bool = False):
    engine = StepEngine(name, log, steps, tokens=8, states=states)
    return StepRun(SimpleNamespace(llm_engine=engine), params=None, asks=asks)


def test_interleave_steps_takes_one_step_of_each_engine_per_turn():
    log: list[str] = []
    variants = {name: step_run(name, log, steps=4) for name in "abc"}
    comp = interleave_steps(Comparison("c", "tok/s", baseline="a"), variants, lambda: [{}] * 2, 2)
    assert all(len(comp.samples[name]) == 2 for name in "abc")
    turns = [log[i : i + 3] for i in range(0, len(log), 3)]
    assert len(turns) == 8 and all(sorted(t) == ["a", "b", "c"] for t in turns)
    assert len({tuple(t) for t in turns}) > 1  # the order changes between turns
    assert all(v > 0 for values in comp.samples.values() for v in values)


def test_interleave_steps_stops_stepping_an_engine_once_it_is_done():
    log: list[str] = []
    variants = {"short": step_run("short", log, steps=2), "long": step_run("long", log, 5)}
    interleave_steps(Comparison("c", "tok/s", baseline="short"), variants, lambda: [{}], 1)
    assert log.count("short") == 2 and log.count("long") == 5


def test_interleave_steps_fails_a_variant_whose_requests_come_back_without_states():
    log: list[str] = []
    variants = {"plain": step_run("plain", log, 2), "asks": step_run("asks", log, 2, False, True)}
    with pytest.raises(RuntimeError, match="asks: .* has no hidden states"):
        interleave_steps(Comparison("c", "tok/s", baseline="plain"), variants, lambda: [{}], 1)


def test_in_process_engines_sets_and_restores_its_variables(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with in_process_engines(VLLM_CPU_KVCACHE_SPACE="1"):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    with in_process_engines():
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_model_shape_names_a_comparison_by_its_layers_width_and_architecture(tmp_path):
    from benchmarks.small_model import model_shape

    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 896}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_shape(tmp_path) == "4 x 896 Llama"
