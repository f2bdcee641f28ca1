"""The peer: the webhook task a Python team would write with Celery on RabbitMQ (late acks, retries with
backoff and jitter), measured against the same receiver as hookline, in the same run.

Usage: python -m bench.celery_peer AMQP_URL N POOL CONCURRENCY URL MODE   (MODE: backlog | live)
→ prints {"deliveries_per_s": ...} as JSON; the receiver's arrival times give the rate, as for hookline.

``backlog``: N tasks wait in the queue before the worker starts; ``live``: the worker runs first (one
warm-up task must arrive), then N tasks are sent while it delivers. The task neither signs nor validates:
what a first version would do, so the comparison flatters Celery.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import requests
from celery import Celery

app = Celery("hookline_bench_peer", broker=os.environ.get("BENCH_CELERY_BROKER", "amqp://"))
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=4,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    task_default_queue="hookline-bench-celery",
    worker_hijack_root_logger=False,
)
session = requests.Session()


class RetryableError(Exception):
    pass


@app.task(  # type: ignore[untyped-decorator]
    bind=True,
    autoretry_for=(requests.RequestException, RetryableError),
    retry_backoff=30,
    retry_jitter=True,
    max_retries=5,
)
def deliver(self: Any, url: str, event_id: str, payload: dict[str, Any]) -> None:
    response = session.post(url, json=payload, headers={"webhook-id": event_id}, timeout=15)
    if response.status_code in (408, 429) or response.status_code >= 500:
        raise RetryableError(response.status_code)


def _count(url: str) -> int:
    return int(httpx.get(url.rsplit("/", 1)[0] + "/__count", timeout=5).text)


def _wait_for(url: str, expected: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while _count(url) < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the receiver did not get {expected} requests in {timeout_s}s")
        time.sleep(0.1)


def main(amqp_url: str, count: int, pool: str, concurrency: int, url: str, mode: str) -> None:
    # The task as the worker knows it: under its module's name, not as ``__main__.deliver``.
    from bench import celery_peer

    celery_peer.app.conf.broker_url = amqp_url
    payload = {"data": {"x": "a" * 1000}}
    worker_env = dict(os.environ, BENCH_CELERY_BROKER=amqp_url)
    command = [sys.executable, "-m", "celery", "-A", "bench.celery_peer", "worker", "-P", pool]
    command += ["-c", str(concurrency), "-l", "warning", "--without-heartbeat", "--without-gossip"]
    command += ["--without-mingle"]

    def send(prefix: str, n: int) -> dict[str, float]:
        sent: dict[str, float] = {}
        for k in range(n):
            sent[f"{prefix}{k}"] = time.time()
            celery_peer.deliver.delay(url, f"{prefix}{k}", payload)
        return sent

    worker: subprocess.Popen[bytes] | None = None
    try:
        if mode == "backlog":
            sent = send("celery-b", count)
            worker = subprocess.Popen(
                command, env=worker_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            _wait_for(url, count)
        else:
            worker = subprocess.Popen(
                command, env=worker_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            send("celery-warm", 1)
            _wait_for(url, 1)
            sent = send("celery-l", count)
            _wait_for(url, count + 1)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(60)
        with celery_peer.app.connection_for_write() as connection:
            connection.default_channel.queue_delete("hookline-bench-celery")
    print(json.dumps({"sent": sent}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
