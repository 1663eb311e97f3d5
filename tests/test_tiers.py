"""The tier guard of conftest.py: a test outside the `slow` tier that trains or starts a process fails."""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from conftest import TIER_LEAKS, TierLeak


def test_a_fast_test_that_starts_a_process_or_trains_is_stopped_before_it_does(request):
    starts = [
        lambda: subprocess.run(["true"], check=True),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        os.fork,
    ]
    for start in starts:
        with pytest.raises(TierLeak, match=r"starts a process .*outside the slow tier: mark it @pytest.mark.slow"):
            start()
    import tuneforge.train.run
    from tuneforge.train.loop import Trainer

    for train in (lambda: tuneforge.train.run.setup(*[None] * 7), lambda: Trainer.run(None)):
        with pytest.raises(TierLeak, match=r"trains .*mark it @pytest.mark.slow"):
            train()
    assert len(request.node.stash[TIER_LEAKS]) == 5
    request.node.stash[TIER_LEAKS].clear()  # caught here on purpose: the test passes


@pytest.mark.trivial_process("`true`, to show the marker lets it through")
def test_a_trivial_process_with_its_reason_is_let_through():
    subprocess.run(["true"], check=True)


@pytest.mark.slow
def test_the_slow_tier_starts_processes():
    subprocess.run(["true"], check=True)
