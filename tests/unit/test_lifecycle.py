"""A service's process entry: the niceness it yields the CPU with (HOOKLINE_NICE)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, sys
from hookline.shared.runtime import lifecycle

async def main() -> None:
    print(os.nice(0) - int(sys.argv[1]))

lifecycle.run(main, nice=int(sys.argv[2]))
"""


@pytest.mark.parametrize("nice", [0, 10])
def test_a_service_runs_at_the_niceness_it_was_given_more(nice: int) -> None:
    before = os.nice(0)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(before), str(nice)], capture_output=True, text=True, check=True
    )
    assert int(done.stdout) == min(nice, 19 - before)


GC_SCRIPT = """
import gc
from hookline.shared.runtime import lifecycle

async def main() -> None:
    print(*gc.get_threshold())

lifecycle.run(main)
"""


def test_a_service_runs_with_the_collector_s_thresholds_raised() -> None:
    from hookline.shared.runtime.lifecycle import GC_THRESHOLDS

    done = subprocess.run([sys.executable, "-c", GC_SCRIPT], capture_output=True, text=True, check=True)
    assert tuple(int(n) for n in done.stdout.split()) == GC_THRESHOLDS
    assert GC_THRESHOLDS[0] > 700  # CPython's default, which a delivery's allocations set off every few
