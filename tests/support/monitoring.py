"""What tests ask of the running services over their APIs: the monitor's JSON, its leadership, an
endpoint paused or resumed, events published as an upstream would."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx

from support import services
from support.amqp import event, publish_event
from support.system import System
from support.waiting import eventually

AUTH = {"authorization": f"Bearer {services.TOKEN}"}


async def publish(system: System, who: str, event_type: str, ids: Iterable[str]) -> list[str]:
    published = []
    for event_id in ids:
        await publish_event(system.amqp_url, event(who, event_type, event_id), f"{who}.{event_type}")
        published.append(event_id)
    return published


async def counted(system: System, series: str) -> float:
    """A counter of the dispatchers' /metrics, summed over them."""
    total = 0.0
    async with httpx.AsyncClient(timeout=10) as client:
        for dispatcher in system.dispatchers:
            for line in (await client.get(f"{dispatcher.base_url}/metrics")).text.splitlines():
                if line.startswith(series + " "):
                    total += float(line.split()[-1])
    return total


async def get_json(service: services.Service, path: str, **params: str) -> Any:
    """The JSON a service answers to GET ``path``; None while it does not answer 200."""
    async with httpx.AsyncClient(base_url=service.base_url, headers=AUTH, timeout=10) as client:
        try:
            response = await client.get(path, params=params)
        except httpx.HTTPError:
            return None
    return response.json() if response.status_code == 200 else None


async def wait_leader(monitor: services.Service, timeout_s: float = 20) -> float:
    """Wait until ``monitor`` says it leads; returns when (time.monotonic())."""

    async def leading() -> bool:
        summary = await get_json(monitor, "/v1/status")
        return summary is not None and summary["leader"] is True

    await eventually(leading, timeout_s=timeout_s, every_s=0.05)
    return time.monotonic()


async def set_status(system: System, endpoint_id: str, action: str) -> None:
    async with httpx.AsyncClient(base_url=system.ingest.base_url, headers=AUTH, timeout=30) as client:
        response = await client.post(f"/v1/endpoints/{endpoint_id}/{action}")
    assert response.status_code == 200, response.text
