"""``hookline export`` of a large change log (issue 24): T tenants with E endpoints each written straight
to the change log (as bench/million.py writes them), then the export run as an operator runs it, its
output to a file. Reported: its wall time and its peak RSS (``/usr/bin/time``), and the lines written;
then the same for the export as it was before it streamed (everything parsed in memory first).

    .venv/bin/python -m bench.export --tenants 5000 --per-tenant 20      # 100,000 endpoints
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.million import write_log
from bench.run import HOOKLINE, vhost

#: The export before it streamed: the whole state parsed in memory (a registry in memory, every endpoint
#: in a list), then written; the same code paths, for a ratio in the same run.
_IN_MEMORY = """
import asyncio, sys
from datetime import UTC, datetime
from hookline.cli import backup
from hookline.shared.runtime.settings import CommonSettings, load

async def main():
    settings = load(CommonSettings)
    async with backup._broker(settings) as broker:
        async with backup._following(broker, settings.connect_timeout_s) as change_log:
            snapshot = backup.Snapshot.of(change_log)
    for line in snapshot.lines(vhost=broker.vhost, now=datetime.now(UTC)):
        sys.stdout.buffer.write(line + b"\\n")

asyncio.run(main())
"""


def export(amqp_url: str, *, in_memory: bool = False) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLINE_")}
    env.update({"HOOKLINE_AMQP_URL": amqp_url, "HOOKLINE_CONNECT_TIMEOUT_S": "600"})
    with tempfile.TemporaryDirectory(prefix="hookline-export-bench-") as work:
        out = Path(work) / "backup.jsonl"
        started = time.perf_counter()
        with out.open("wb") as stdout:
            done = subprocess.run(
                ["/usr/bin/time", "-v", *([sys.executable, "-c", _IN_MEMORY] if in_memory else [HOOKLINE, "export"])],
                stdout=stdout, stderr=subprocess.PIPE, env=env, check=False,
            )  # fmt: skip
        wall_s = time.perf_counter() - started
        stderr = done.stderr.decode(errors="replace")
        peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
        with out.open("rb") as lines:
            written = sum(1 for _ in lines)
        return {
            "returncode": done.returncode,
            "wall_s": round(wall_s, 1),
            "peak_rss_mib": round(int(peak.group(1)) / 1024, 1) if peak else None,
            "lines": written,
            "bytes": out.stat().st_size,
            "said": [line for line in stderr.splitlines() if line.startswith("hookline:")],
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--tenants", type=int, default=5_000)
    parser.add_argument("--per-tenant", type=int, default=20)
    args = parser.parse_args()
    assert shutil.which("/usr/bin/time"), "needs /usr/bin/time (GNU time) for the peak RSS"
    with vhost(args.amqp_url) as amqp_url:
        log_written_s = asyncio.run(write_log(amqp_url, args.tenants, args.per_tenant, 9))
        result = {"endpoints": args.tenants * args.per_tenant, "log_written_s": round(log_written_s, 1)}
        result["streamed"] = export(amqp_url)
        result["in_memory"] = export(amqp_url, in_memory=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
