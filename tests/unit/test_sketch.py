"""The latency sketch against exact percentiles on random data: within its stated relative error."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from hookline.health_monitor.sketch import RELATIVE_ERROR, LatencySketch


def exact(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


@pytest.mark.parametrize(
    "distribution",
    [
        lambda rng: rng.lognormvariate(3, 1),  # a typical long-tailed latency
        lambda rng: rng.uniform(1, 15000),
        lambda rng: rng.expovariate(1 / 50),
        lambda rng: rng.choice([5.0, 5000.0]),  # bimodal: fast answers and timeouts
        lambda rng: 0.001,  # below the smallest bucket
    ],
)
@pytest.mark.parametrize("q", [0.5, 0.9, 0.95, 0.99, 0.999, 0.0, 1.0])
def test_quantiles_are_within_the_relative_error(distribution: object, q: float) -> None:
    rng = random.Random(42)
    values = [distribution(rng) for _ in range(20_000)]  # type: ignore[operator]
    sketch = LatencySketch()
    for value in values:
        sketch.add(value)
    estimate = sketch.quantile(q)
    truth = max(exact(values, q), 0.01)
    assert estimate is not None
    assert abs(estimate - truth) <= RELATIVE_ERROR * truth + 1e-9, (estimate, truth)


def test_merging_equals_adding_everything_to_one() -> None:
    rng = random.Random(1)
    a, b, both = LatencySketch(), LatencySketch(), LatencySketch()
    for n in range(5000):
        value = rng.lognormvariate(4, 1.5)
        (a if n % 3 else b).add(value)
        both.add(value)
    a.merge(b)
    assert a.bins == both.bins
    assert a.count == both.count == 5000


def test_memory_is_bounded_by_the_range_not_the_samples() -> None:
    sketch = LatencySketch()
    rng = random.Random(3)
    for _ in range(100_000):
        sketch.add(rng.uniform(0.01, 600_000))
    assert len(sketch.bins) < 1000


def test_empty() -> None:
    assert LatencySketch().quantile(0.5) is None


def test_merging_sketches_over_other_ranges_grows_the_array_both_ways() -> None:
    low, high, middle, both = LatencySketch(), LatencySketch(), LatencySketch(), LatencySketch()
    for value in (0.5, 1.0, 2.0):
        low.add(value)
        both.add(value)
    for value in (5_000.0, 10_000.0):
        high.add(value)
        both.add(value)
    middle.add(40.0)
    both.add(40.0)
    middle.merge(low)  # below its range
    middle.merge(high)  # above it
    middle.merge(LatencySketch())  # nothing
    assert middle.bins == both.bins
    assert middle.count == 6
    assert middle.quantile(0.0) == pytest.approx(0.5, rel=RELATIVE_ERROR)
    assert middle.quantile(1.0) == pytest.approx(10_000.0, rel=RELATIVE_ERROR)


def test_a_sketch_comes_back_from_its_buckets() -> None:
    rng = random.Random(5)
    sketch = LatencySketch()
    for _ in range(3000):
        sketch.add(rng.lognormvariate(3, 1))
    again = LatencySketch.of(sketch.bins)
    assert (again.bins, again.count) == (sketch.bins, sketch.count)
    assert [again.quantile(q) for q in (0.5, 0.99)] == [sketch.quantile(q) for q in (0.5, 0.99)]


def test_a_full_sketch_is_a_dense_array_of_its_range() -> None:
    """What makes the monitor's memory: 4 bytes per bucket between the lowest and the highest seen."""
    rng = random.Random(9)
    values = [rng.lognormvariate(3, 1) for _ in range(20_000)]  # 1 ms to 2 s and more: ~450 buckets
    tracemalloc.start()
    try:
        sketch = LatencySketch()
        for value in values:
            sketch.add(value)
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    buckets = max(sketch.bins) - min(sketch.bins) + 1
    assert size <= 4 * buckets + 512, (size, buckets)
