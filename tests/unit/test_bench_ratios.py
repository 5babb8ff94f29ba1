# SPDX-License-Identifier: Apache-2.0
"""The benchmark's ratio arithmetic and run order: per-round ratios against
the same round's baseline, their median, their geometric mean with its
standard error, and orders balanced by slot and by predecessor."""

import math
import statistics
from collections import Counter

import pytest

from benchmarks.common import Comparison, alternate, balanced_orders


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
