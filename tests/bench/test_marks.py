"""Host stamps of the timeline's tail marks: stamped only while a request is open, the first pass of each name
counts, the wrapped call's result and errors pass through."""

import pytest

from layerflow.bench.marks import HostStamps


class Steps:
    def __init__(self):
        self.calls = 0

    def issue(self, value):
        self.calls += 1
        if value < 0:
            raise ValueError(f"value={value}")
        return value * 2


def test_stamps_are_taken_only_while_a_request_is_open():
    steps, stamps = Steps(), HostStamps()
    stamps.around(steps, "issue", "before", "after")
    assert steps.issue(1) == 2 and stamps.stamps == {}
    stamps.open()
    assert steps.issue(2) == 4
    got = stamps.close()
    assert list(got) == ["before", "after"] and 0 <= got["before"] <= got["after"]
    steps.issue(3)
    assert stamps.stamps == got and steps.calls == 3


def test_the_first_pass_of_a_name_counts():
    steps, stamps = Steps(), HostStamps()
    stamps.around(steps, "issue", after="issued")
    stamps.open()
    steps.issue(1)
    first = dict(stamps.stamps)
    steps.issue(1)
    assert stamps.close() == first


def test_a_failing_call_raises_through_the_wrap_and_stamps_only_its_start():
    steps, stamps = Steps(), HostStamps()
    stamps.around(steps, "issue", "before", "after")
    stamps.open()
    with pytest.raises(ValueError, match="value=-1"):
        steps.issue(-1)
    assert list(stamps.close()) == ["before"]
