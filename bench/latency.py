"""Publish→delivery latency alone: ``bench.run``'s latency step (2 dispatchers, 10 endpoints of one
tenant, events paced at a rate) without the throughput and peer runs before it, which in a full run
leave the broker and the machine busy for a while after they end.

    .venv/bin/python -m bench.latency --rate-per-s 600 --duration-s 20 --runs 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import uvloop

from bench.run import Services, latency, vhost


async def measure(amqp_url: str, rate_per_s: int, duration_s: float, runs: int) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="hookline-latency-"))
    print(f"logs in {work}", flush=True)
    services = Services(amqp_url, work)
    services.start_ingest()
    try:
        return [await latency(services, work, rate_per_s, duration_s, 10) for _ in range(runs)]
    finally:
        services.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--rate-per-s", type=int, default=600)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    arguments = parser.parse_args()
    with vhost(arguments.amqp_url) as amqp_url:
        results = uvloop.run(measure(amqp_url, arguments.rate_per_s, arguments.duration_s, arguments.runs))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
