"""bridge.publisher.bounded: a call with a bound answers within it, and what it leaves behind is accounted for."""

from __future__ import annotations

import threading
import time

import pytest

from bridge.errors import SyncTimeout
from bridge.publisher.bounded import call_within, each_within


def test_call_within_returns_or_raises_what_the_call_did():
    assert call_within(lambda: 7, 5, "seven") == 7
    with pytest.raises(KeyError, match="nope"):
        call_within(lambda: {}["nope"], 5, "a lookup")


def test_call_within_raises_at_the_bound_and_hands_a_late_result_over():
    release, late, background = threading.Event(), [], []
    t = time.monotonic()
    with pytest.raises(SyncTimeout, match=r"^the group: not all ranks joined within group_timeout=0.2 s$"):
        call_within(lambda: release.wait(10) and "pg", 0.2, "the group: not all ranks joined", bound_name="group_timeout",
                    late=late.append, background=background)
    assert time.monotonic() - t < 5
    release.set()
    background[0].join(5)
    assert late == ["pg"]  # nobody else holds it: the caller's late() releases it


def test_each_within_returns_at_the_bound():
    release, done = threading.Event(), []
    t = time.monotonic()
    each_within(lambda i: (release.wait(10) if i == 2 else None, done.append(i)), [1, 2, 3], 0.3, "wsync-test")
    assert time.monotonic() - t < 5 and sorted(done) == [1, 3]
    release.set()
