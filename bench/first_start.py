"""A first start: one dispatcher building its registry from a change log of T x 20 endpoints, with no file
of its own (a new replica, or one whose file was lost). Reported: seconds until ready, records a second,
and the CPU seconds it spent (from /proc: a first start is bound by the CPU of one process).

    .venv/bin/python -m bench.first_start --tenants 5000       # 100,000 endpoints
    .venv/bin/python -m bench.first_start --tenants 50000      # 1,000,000 (the log alone takes minutes)

``bench.million`` measures the same for all four services in turn, and what follows; this one is the
part a replica added under load waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.million import READY_WITHIN_S, write_log
from bench.run import HOOKLINE, Services, free_port, vhost, wait_ready

PER_TENANT = 20


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def first_start(amqp_url: str, tenants: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hookline-first-start-"))
    services = Services(amqp_url, work, settings={"HOOKLINE_STATE_DIR": str(work / "state")})
    written_s = asyncio.run(write_log(amqp_url, tenants, PER_TENANT, free_port()))
    port = free_port()
    with (work / "dispatcher.log").open("ab") as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            [HOOKLINE, "dispatcher"], env=services.env(HOOKLINE_DISPATCHER_METRICS_PORT=str(port)),
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_ready(port, process, timeout_s=READY_WITHIN_S)
            ready_s = time.perf_counter() - started
            spent_s = cpu_s(process.pid)
        finally:
            process.terminate()
            process.wait()
    records = tenants * PER_TENANT
    return {
        "endpoints": records,
        "log_written_s": round(written_s, 1),
        "ready_s": round(ready_s, 1),
        "records_per_s": round(records / ready_s),
        "cpu_s": spent_s,
        "logs": str(work),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--tenants", type=int, default=5000)
    args = parser.parse_args()
    with vhost(args.amqp_url) as amqp_url:
        print(json.dumps(first_start(amqp_url, args.tenants), indent=2))


if __name__ == "__main__":
    main()
