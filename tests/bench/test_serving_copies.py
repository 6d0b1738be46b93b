"""The copy engine's idle time split by scheduler phase (the CPU half of layerflow.bench.serving_copies)."""

import pytest

from layerflow.bench.serving_copies import OUTSIDE, CopySpan, idle_attribution


def test_idle_is_split_by_the_innermost_phase_and_by_who_was_late():
    # copies busy 0-1 ms and 3-4 ms and 4.5-5 ms; the second issued at 2.5 ms (host late 1.5 ms, device late 0.5 ms),
    # the third issued at 3.8 ms, before the device was free (its 0.5 ms gap is the device's)
    spans = [CopySpan(0.0, 0.0001, 0.0, 0.001), CopySpan(0.0025, 0.0026, 0.003, 0.004),
             CopySpan(0.0038, 0.0039, 0.0045, 0.005)]
    intervals = [("collect", 0.0008, 0.0020), ("answer", 0.0012, 0.0016), ("prepare ahead", 0.0022, 0.0026)]
    got = idle_attribution(spans, intervals)
    assert got["onboardings"] == 3
    assert got["busy_s"] == pytest.approx(0.0025)
    assert got["idle_s"] == pytest.approx(0.0025, abs=1e-9)
    assert got["host_late_s"] == pytest.approx(0.0015)
    assert got["device_late_s"] == pytest.approx(0.0010)
    phases = got["idle_by_phase_s"]
    assert phases["collect"] == pytest.approx(0.0006, abs=2e-5)    # 1.0-1.2 and 1.6-2.0 ms
    assert phases["answer"] == pytest.approx(0.0004, abs=2e-5)
    assert phases["prepare ahead"] == pytest.approx(0.0004, abs=2e-5)
    assert phases[OUTSIDE] == pytest.approx(0.0011, abs=3e-5)     # 2.0-2.2, 2.6-3.0 and 4.0-4.5 ms


def test_overlapping_copies_count_their_union_once():
    spans = [CopySpan(0.0, 0.0, 0.0, 0.002), CopySpan(0.0, 0.0, 0.001, 0.003)]
    got = idle_attribution(spans, [])
    assert got["busy_s"] == pytest.approx(0.003)
    assert got["idle_s"] == 0.0


def test_fewer_than_two_onboardings_have_no_gap():
    assert idle_attribution([CopySpan(0.0, 0.0, 0.0, 0.001)], [])["idle_s"] == 0.0
