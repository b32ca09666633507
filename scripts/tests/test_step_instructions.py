"""scripts/step_instructions.py: Nsight Compute's CSV summed per kernel, and the issue bound."""

from __future__ import annotations

import pytest
import step_instructions

HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
    '"Metric Value"\n'
)


def _row(launch: int, kernel: str, metric: str, unit: str, value: str) -> str:
    return (
        f'"{launch}","1","python3","host","{kernel}","1","7","(128, 1, 1)","(8, 1, 1)","0",'
        f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"\n'
    )


def _csv(launches: list[tuple[str, int, float, float]]) -> str:
    """(kernel, warp instructions, duration ns, clock Hz) per launch, after a profiler line."""
    text = "==PROF== Connected to process 1\n" + HEADER
    for i, (kernel, inst, ns, hz) in enumerate(launches):
        text += _row(i, kernel, "gpu__time_duration.sum", "ns", f"{ns:,.0f}")
        text += _row(i, kernel, "smsp__cycles_elapsed.avg.per_second", "hz", f"{hz:.0f}")
        text += _row(i, kernel, "smsp__inst_executed.sum", "inst", f"{inst:,}")
    return text


def _total(summary: str) -> list[str]:
    return next(line for line in summary.splitlines() if line.startswith("total")).split()


def test_sums_launches_and_bounds_issue_at_the_median_clock() -> None:
    launches = [
        ("_tile", 3_000_000, 250_000.0, 1.9e9),
        ("_tile", 1_000_000, 50_000.0, 2.0e9),
        ("_stats", 500_000, 100_000.0, 1.5e9),
    ]
    summary = step_instructions.summarize(_csv(launches), params=1_000_000, sms=2)
    _, count, inst, per_param, ms, bound = _total(summary)
    assert int(count) == 3
    assert float(inst) == pytest.approx(4.5e6, rel=1e-3)
    assert float(per_param) == pytest.approx(4.5e6 * 32 / 1e6, abs=0.05)
    assert float(ms) == pytest.approx(0.4, abs=5e-4)
    # 2 SMs x 4 schedulers at the median clock, 1.9 GHz: 4.5e6 / 15.2e9 s.
    assert float(bound) == pytest.approx(4.5e6 / (8 * 1.9e9) * 1e3, abs=5e-4)
    tile = next(line for line in summary.splitlines() if line.startswith("_tile")).split()
    assert int(tile[1]) == 2 and float(tile[2]) == pytest.approx(4e6, rel=1e-3)


def test_clock_override_and_unknown_units() -> None:
    text = _csv([("_k", 1_000_000, 10_000.0, 1.5e9)])
    summary = step_instructions.summarize(text, params=32, sms=1, clock_hz=2.0e9)
    assert float(_total(summary)[-1]) == pytest.approx(1e6 / (4 * 2.0e9) * 1e3, abs=5e-4)
    assert "measured: 1.500" in summary
    with pytest.raises(KeyError):
        step_instructions.summarize(text.replace('"ns"', '"furlong"'), params=32, sms=1)


def test_clock_units_and_a_profile_without_clocks() -> None:
    text = _csv([("_k", 2_000_000, 10_000.0, 1.0)])
    per_ns = text.replace('"hz","1"', '"cycle/nsecond","1.6"').replace('"ns"', '"NS"')
    summary = step_instructions.summarize(per_ns, params=32, sms=1)
    assert "measured: 1.600" in summary
    assert float(_total(summary)[4]) == pytest.approx(0.01, abs=5e-4)
    no_clock = "".join(line for line in text.splitlines(True) if "cycles_elapsed" not in line)
    with pytest.raises(ValueError, match="clock_hz"):
        step_instructions.summarize(no_clock, params=32, sms=1)
    summary = step_instructions.summarize(no_clock, params=32, sms=1, clock_hz=1e9)
    assert float(_total(summary)[-1]) == pytest.approx(2e6 / 4e9 * 1e3, abs=5e-4)
