# SPDX-License-Identifier: Apache-2.0
"""The benchmark's ratio arithmetic: per-round ratios against the same round's
baseline, their median, and the mean with its standard error."""

import statistics

import pytest

from benchmarks.common import Comparison


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


def test_mean_ratio_carries_the_standard_error_of_the_rounds():
    ratios = [0.9, 0.95, 1.0, 1.05]
    comp = comparison([100.0] * 4, [100.0 * r for r in ratios])
    mean, stderr = comp.ratio_mean_stderr("asks")
    assert mean == pytest.approx(statistics.fmean(ratios))
    assert stderr == pytest.approx(statistics.stdev(ratios) / 2)


def test_one_round_has_no_standard_error():
    assert comparison([100.0], [97.0]).ratio_mean_stderr("asks") == (pytest.approx(0.97), 0.0)


def test_summary_reports_mean_and_standard_error_beside_the_median():
    comp = comparison([100.0, 100.0], [96.0, 98.0])
    comp.targets["asks"] = 0.97
    entry = comp.summary()["variants"]["asks"]
    assert entry["ratio"] == pytest.approx(0.97)
    assert entry["ratio_mean"] == pytest.approx(0.97)
    assert entry["ratio_stderr"] == pytest.approx(0.01)
    assert entry["meets_target"] is True
