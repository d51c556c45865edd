"""The benchmarks' arithmetic: BENCHMARKS.md's verdicts (targets 1, 7, 8 and 10's rows) are
computed from their numbers, and the interleaved pairing cancels a speed difference between
its two engines.

Synthetic repetitions with a known treatment cost and a known engine bias are the ground
truth here: these functions only do arithmetic, which no engine run could check as
exactly. The measurements themselves are ``./scripts/bench``'s.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the scripts import their ``harness`` module
    try:
        spec = importlib.util.spec_from_file_location(f"kvguard_bench_{name}",
                                                      BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


harness = _module("harness")
report = _module("report")
throughput = _module("bench_throughput")


def _repetition(on: int, *, cost: float, engine0_slower: float, jitter: float) -> dict[str, Any]:
    """One interleaved repetition: 1 s of work per engine, engine 0 ``engine0_slower``
    times slower, the treated engine ``on`` ``cost`` times slower, the whole machine
    ``jitter`` times slower at that moment (both engines alike: they ran interleaved)."""
    seconds = [jitter * engine0_slower, jitter * 1.0]
    seconds[on] *= cost
    n = throughput.REQUESTS * throughput.OUTPUT_TOKENS
    return {"seconds": seconds, "gc_seconds": [0.0, 0.0], "tokens": [n, n],
            "steps": [254, 254]}


def test_pairing_cancels_engine_bias_and_machine_speed() -> None:
    pairs = harness.Pairs(throughput.REQUESTS * throughput.OUTPUT_TOKENS, 10, 0.005)
    for jitter in (1.0, 1.3, 0.8, 1.1):
        got = {on: _repetition(on, cost=1.02, engine0_slower=1.05,
                               jitter=jitter * (1.07 if on else 1.0))
               for on in (0, 1)}
        pairs.add(got)
    # Throughput with the treatment over without: 1 / 1.02 in every pair, whatever the
    # engines' own difference and however fast the machine ran each repetition.
    assert pairs.ratios == pytest.approx([1 / 1.02] * 4, rel=1e-12)
    assert statistics.fmean(pairs.engine_ratios) == pytest.approx(1.05, rel=1e-12)
    row = pairs.row("interleaved-sync")
    assert row["mean_ratio"] == pytest.approx(1 / 1.02)
    assert row["ci95_half_width"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("mean", "half", "expected"), [
    (0.996, 0.004, "**pass**"),          # at the target's width: the mean decides
    (0.987, 0.004, "**miss**"),
    (1.010, 0.015, "**pass**"),          # wider, but wholly above 0.99
    (0.960, 0.020, "**miss**"),          # wider, wholly below
    (0.990, 0.030, "**not resolved**"),  # wider, straddling 0.99
])
def test_throughput_verdict_follows_the_numbers(mean: float, half: float,
                                                expected: str) -> None:
    row = {"mean_ratio": mean, "ci95_half_width": half, "ratios": [mean - half, mean + half]}
    assert harness.throughput_verdict(row, 0.99, 0.005).startswith(expected)


def _control(null: tuple[float, float], burn: tuple[float, float],
             expected: float) -> str:
    def side(m: float, h: float) -> dict[str, Any]:
        return {"mean_ratio": m, "ci95_half_width": h, "pairs": 11}
    row = {"mode": "interleaved-control-sync", "burn_us_per_step": 70.0,
           "burn_expected_ratio": expected, "null": side(*null), "burn": side(*burn)}
    cell: str = report.throughput_control_row(row, 0.005).rsplit("|", 2)[1]
    return cell.strip()


def test_control_row_checks_both_values_against_their_intervals() -> None:
    assert _control((1.003, 0.005), (0.984, 0.005), 0.982) == "**pass**, **pass**"
    # An interval at the target's width that misses the value it must hold fails...
    assert _control((0.997, 0.002), (0.970, 0.004), 0.982) == "**fail**, **fail**"
    # ...a wider one that misses it only says it could not tell.
    assert _control((0.990, 0.008), (0.982, 0.001), 0.982) == "**not resolved**, **pass**"


def _process_row(mean: float, half: float) -> dict[str, Any]:
    n = throughput.REQUESTS * throughput.OUTPUT_TOKENS
    return {"mean_ratio": mean, "ci95_half_width": half, "ratios": [mean] * 10,
            "seconds_on": [n / 1000.0] * 20, "seconds_off": [n / 1010.0] * 20,
            "engine_time_ratio": 1.01, "gc_share_on": 0.001, "gc_share_off": 0.001,
            "steps_per_repetition": 254}


def test_judged_over_processes_not_over_their_pairs() -> None:
    # Three processes, each sure of itself to +-0.1 %, that disagree by about 0.5 %:
    # the interval is the processes' (t with 2 degrees of freedom), not the pairs'.
    row = harness.across_processes(
        "interleaved-async", [_process_row(m, 0.001) for m in (0.985, 0.990, 0.995)],
        throughput.REQUESTS * throughput.OUTPUT_TOKENS)
    assert row["mean_ratio"] == pytest.approx(0.990)
    assert row["ci95_half_width"] == pytest.approx(4.303 * 0.005 / 3 ** 0.5, rel=1e-3)
    assert row["pairs"] == 30 and row["processes"] == 3
    verdict = harness.throughput_verdict(row, 0.99, 0.005)
    assert verdict.startswith("**not resolved**") and "processes" in verdict


def _release(vllm: str, *, mismatched: int = 0, leak: int = 0) -> dict[str, Any]:
    return {"vllm": vllm, "rounds": 40, "mean_ratio": 1.09, "interval_half": 0.02,
            "without_us": {"mean": 320.0}, "steps_per_round": 164.0,
            "preemptions_per_round": 18.6, "prefix_hit_tokens_per_round": 2200.0,
            "rounds_mismatched": mismatched,
            "verdicts": {"saturated": 40, **({"leak": leak} if leak else {})}}


@pytest.mark.parametrize(("releases", "valid"), [
    ([_release("0.32.0"), _release("0.33.0")], True),
    ([_release("0.32.0"), _release("0.33.0", leak=1)], False),
    ([_release("0.32.0", mismatched=2), _release("0.33.0")], False),
])
def test_releases_row_is_valid_only_with_the_same_work_and_no_leak(
        releases: list[dict[str, Any]], valid: bool) -> None:
    (row,) = report.releases_row_of({"releases": releases, "requests": 48}, 1.02)
    verdict = row.rsplit("|", 2)[1]
    assert ("not valid" in verdict) is not valid
    assert ("same work each round" in row) is not any(r["rounds_mismatched"]
                                                           for r in releases)
    assert "0.32.0 **1.090x**" in row and "0.33.0 **1.090x**" in row


def test_median_interval_is_the_binomial_order_statistics() -> None:
    # The ranks every table gives (40 rounds: the 14th and 27th; 100: the 40th and 61st),
    # and the exact coverage they promise, computed here from the binomial itself.
    assert harness.median_interval(list(range(1, 41))) == (14, 27)
    assert harness.median_interval(list(range(100, 0, -1))) == (40, 61)
    n, k = 40, 14
    coverage = sum(math.comb(n, i) for i in range(k, n - k + 1)) / 2 ** n
    assert coverage >= 0.95
    assert sum(math.comb(n, i) for i in range(k + 1, n - k)) / 2 ** n < 0.95  # the narrowest
    assert harness.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few: the range


@pytest.mark.parametrize(("shift", "expected"), [
    (0.97, "**pass**"), (1.07, "**miss**"), (1.02, "**not resolved**")])
def test_target_1_is_judged_by_the_medians_interval(shift: float, expected: str) -> None:
    # 40 rounds spread +-2 % around ``shift``: the interval's side of 1.02 decides.
    xs = [shift + 0.001 * (i - 20) for i in range(40)]
    assert harness.median_verdict(xs, 1.02).startswith(expected)


def test_benchmarks_md_is_rendered_from_the_committed_results() -> None:
    # BENCHMARKS.md is what ``bench/run_all.py --render`` writes: no figure typed by hand,
    # and its first table stays one line per row, one short cell each.
    text = (BENCH.parent / "BENCHMARKS.md").read_text()
    assert text == report.render()
    # The what-if note is frozen: it names the last commit whose script rendered it.
    assert "bc8a5e7de8d162ad21615122989d9f1dfcb44ee7" in (BENCH / "results" /
                                                         "what_if.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table and all(len(cell) <= 120 for line in table for cell in line.split("|"))


def test_the_demos_end_to_end_figure_is_the_benchmarks() -> None:
    # ``kvguard demo`` quotes the end-to-end cost at the defaults: it must be what target
    # 7's committed interleaved rows measure, to the two places the demo prints.
    from kvguard.demo.run import END_TO_END_AT_DEFAULTS

    rows = [r for r in report.load("throughput")["rows"]
            if r["mode"] in ("interleaved-sync", "interleaved-async")]
    assert rows and all(round(r["mean_ratio"], 2) == END_TO_END_AT_DEFAULTS for r in rows)


@pytest.mark.parametrize(("mean", "half", "expected"), [
    (1.0003, 0.0036, "**pass**"),  # 2026-12-06: within +-0.5 %, holds 1.00x
    (1.0100, 0.0220, "**miss**"),  # holds 1.00x, but too wide to say "no change"
    (0.9900, 0.0040, "**miss**"),  # narrow, and a measurable cost
])
def test_target_10_is_no_change_only_with_a_narrow_interval_holding_one(
        mean: float, half: float, expected: str) -> None:
    row = {"mean_ratio": mean, "ci95_half_width": half}
    assert harness.no_change_verdict(row, report.TARGET_HALF_KV) == expected


def test_abba_reverses_the_order_every_other_round() -> None:
    # Every side first as often: a drift within a round falls on all alike.
    budget = harness.RoundBudget("KVGUARD_BENCH_TEST_UNSET", 0.0, min_rounds=4,
                                 max_rounds=4, step=2)
    seen: list[tuple[int, str]] = []
    rounds = harness.abba(budget, ("a", "b", "c"), lambda r, m: seen.append((r, m)) or m)
    assert [m for _, m in seen] == list("abccbaabccba")
    assert [r for r, _ in seen] == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    assert rounds == [{"a": "a", "b": "b", "c": "c"}] * 4


def _pd_run(pair: int, side: str, wall: float, lapses: float = 0.0) -> dict[str, Any]:
    return {"pair": pair, "side": side, "wall_s": wall, "decode_ttft_s": [0.1, 0.2],
            "lapses": lapses, "late_reads": 0.0, "kvguard_loaded": side != "off",
            "lapse_lines": 0}


def test_pd_verdict_is_the_median_paired_wall_ratio_and_kvguards_own_lapses() -> None:
    sys.path.insert(0, str(BENCH.parent / "tests" / "pd"))  # bench_pd imports the pair
    try:
        pd = _module("bench_pd")
    finally:
        sys.path.remove(str(BENCH.parent / "tests" / "pd"))
    # Pairs at different machine speeds; kvguard 3 % slower in each: passes.
    runs = [r for i, speed in enumerate((1.0, 2.0, 0.7))
            for r in (_pd_run(i, "off", 5 * speed), _pd_run(i, "on", 5 * speed * 1.03))]
    s = pd.summarize(runs, ["off", "on"])["on"]
    assert s["wall_ratio_median"] == 1.03 and s["verdict"] == "PASS"
    # One pair 10 % slower is not the median; a lapse that also happened without it is
    # not kvguard's.
    runs[1] = _pd_run(0, "on", 5.5, lapses=1)
    runs[0] = _pd_run(0, "off", 5.0, lapses=1)
    assert pd.summarize(runs, ["off", "on"])["on"]["verdict"] == "PASS"
    # A lapse only with kvguard fails, whatever the walls say.
    runs[0] = _pd_run(0, "off", 5.0)
    s = pd.summarize(runs, ["off", "on"])["on"]
    assert s["lapse_pairs_without_off_lapse"] == 1 and s["verdict"] == "FAIL"
    # A lapse vLLM logged outside the workload's counter window (the handshake) counts.
    runs[1] = {**_pd_run(0, "on", 5.0), "lapse_lines": 1}
    assert pd.summarize(runs, ["off", "on"])["on"]["lapse_pairs"] == [0]
    # 6 % slower in every pair fails.
    runs = [r for i in range(3) for r in (_pd_run(i, "off", 5.0), _pd_run(i, "on", 5.3))]
    assert pd.summarize(runs, ["off", "on"])["on"]["verdict"] == "FAIL"
