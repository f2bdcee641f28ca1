"""The dashboards and alert rules under deploy/ against what the services really export.

Every metric a PromQL expression of the Grafana dashboard or of the Prometheus alert rules names must
be served on the ``/metrics`` of at least one service: a renamed metric, a counter without its
``_total`` or a histogram without ``_bucket`` would otherwise leave a panel empty and an alert silent,
and nothing would say so. The real system is started and driven (a success, a retry, a dead letter,
canaries) so that the series created on first use exist when it is scraped, with the bearer token
Prometheus is given; ``/metrics`` answers nothing without it. The compose profile ``observability``
and the files it mounts are checked as far as can be without a Docker engine.

And (from test_canaries.py, on a system of its own with that module's settings): canaries with the real
services: the leading monitor publishes one every half second to the canary tenant's endpoint; its
latency is exported; a failing endpoint fires canary_failed, a slow one canary_late; both resolve once
canaries arrive again.

And (from test_traces.py, each test on a system of its own with that module's settings): traces, as an
SRE following one event in their tracing backend: the publisher's ``traceparent`` (over HTTP or as an
AMQP header) reaches every attempt at the receiver, and with HOOKLINE_OTLP_ENDPOINT set hookline's spans
(``hookline.publish`` at the ingest, one ``hookline.deliver`` per attempt) are exported over OTLP/HTTP
to a real collector endpoint, linked parent to child.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families
from support import postgres, services
from support.amqp import publish_event
from support.monitoring import AUTH, get_json
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

from hookline.dispatcher.settings import DispatcherSettings
from hookline.health_monitor.settings import MonitorSettings
from hookline.ingest.settings import IngestSettings
from hookline.outbox_relay.settings import OutboxRelaySettings

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "hookline.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "compose.yaml"

#: The read-only token Prometheus scrapes with; the system below runs with it, dispatchers included.
METRICS_TOKEN = "metrics-token-0123456789abcdef"

SYSTEM_ENV = {
    # Canaries, so that the canary latency series exists; a fast tick and queue poll, so that the
    # monitor's per-endpoint series appear within seconds.
    "HOOKLINE_CANARY_INTERVAL_S": "0.5",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_METRICS_TOKEN": METRICS_TOKEN,
}

#: Made by Prometheus for each target, not by any service.
SCRAPE_SERIES = frozenset({"up"})
#: Declared by the services but without a series until something goes wrong (a background loop
#: restarted, an alert sink failing): for these the declaration is what is checked.
ONLY_AFTER_A_FAULT = frozenset(
    {
        "hookline_loop_restarts_total",
        "hookline_alert_sink_failures_total",
        "hookline_state_files_set_aside_total",
    }
)


def words(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Aggregation operators: followed by "(" or by their "by (...)" / "without (...)" clause.
AGGREGATIONS = words(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio"
)
#: PromQL's functions and aggregation operators: an identifier followed by "(" must be one of them.
FUNCTIONS = AGGREGATIONS | words(
    """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp
    clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month
    deg delta deriv exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
    histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase irate
    label_join label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time
    minute month pi predict_linear present_over_time quantile_over_time rad rate resets round scalar
    sgn sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time
    stdvar_over_time sum_over_time tan tanh time timestamp vector year start end
    """
)
#: Keywords and binary operators written as words; Inf and NaN are number literals.
KEYWORDS = words("and or unless atan2 by without on ignoring group_left group_right bool offset inf nan")
#: Keywords followed by a parenthesised list of label names, not of expressions.
LABEL_LISTS = words("by without on ignoring group_left group_right")

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<variable>\$\{[^}]*\}|\$\w+)
    | (?P<number>0x[0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)
    | (?P<identifier>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<operator>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]@])
    """,
    re.VERBOSE,
)


def tokens(expr: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    at = 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise ValueError(f"cannot read {expr[at:]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            found.append((kind, match.group()))
        at = match.end()
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers used bare or before ``{`` or ``[``,
    and ``__name__="..."`` matchers; not functions, keywords, label names (in ``{...}`` and in
    ``by (...)``-like lists), durations, numbers, strings or Grafana's ``$variables``."""
    found: set[str] = set()
    toks = tokens(expr)
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        following = toks[i + 1][1] if i + 1 < len(toks) else None
        if text == "{":  # label matchers: names and values, except a __name__ matcher
            close = _closing(toks, i, "}")
            found |= _name_matchers(toks[i + 1 : close], expr)
            i = close
        elif text == "[":  # a range or subquery: durations and $__rate_interval
            i = _closing(toks, i, "]")
        elif kind == "identifier" and text.lower() in LABEL_LISTS and following == "(":
            i = _closing(toks, i, ")")
        elif kind == "identifier" and _is_metric(text, following, expr):
            found.add(text)
        i += 1
    return found


def _closing(toks: list[tuple[str, str]], start: int, bracket: str) -> int:
    return next(j for j in range(start, len(toks)) if toks[j][1] == bracket)


def _name_matchers(matchers: list[tuple[str, str]], expr: str) -> set[str]:
    found = set()
    for j, (_, name) in enumerate(matchers):
        if name == "__name__":
            operator, (value_kind, value) = matchers[j + 1][1], matchers[j + 2]
            if operator != "=" or value_kind != "string":
                raise ValueError(f"a __name__ matcher other than = names no one metric: {expr!r}")
            found.add(value[1:-1])
    return found


def _is_metric(identifier: str, following: str | None, expr: str) -> bool:
    if identifier.lower() in KEYWORDS:
        return False
    if identifier in AGGREGATIONS and following in ("by", "without"):
        return False
    if following == "(":
        if identifier not in FUNCTIONS:
            raise ValueError(f"{identifier}() is no PromQL function in {expr!r}")
        return False
    return True


def dashboard_expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every panel target's ``expr`` (rows may nest panels), and the PromQL inside the template
    variables' ``label_values(EXPR, label)`` and ``query_result(EXPR)``."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard.get("panels", []))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        wrapped = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*|\s*query_result\((.*)\)\s*", text)
        if wrapped is None:
            raise ValueError(f"template variable {variable['name']}: cannot read {text!r}")
        found.append(wrapped.group(1) or wrapped.group(2))
    return found


def alert_rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(ALERTS.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def expressions() -> list[str]:
    return dashboard_expressions(json.loads(DASHBOARD.read_text())) + [r["expr"] for r in alert_rules()]


def referenced(exprs: Iterable[str]) -> set[str]:
    return set().union(*(metric_names(expr) for expr in exprs)) - SCRAPE_SERIES


def declared_names(exposition: str) -> tuple[set[str], set[str]]:
    """The names with a sample, and the names a declared family would have samples under (a labelled
    metric shows only its HELP and TYPE until a label value is first used)."""
    sampled: set[str] = set()
    declared: set[str] = set()
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_sum", "_count"],
        "summary": ["_sum", "_count"],
    }
    for family in text_string_to_metric_families(exposition):
        sampled.update(sample.name for sample in family.samples)
        declared.update(family.name + suffix for suffix in suffixes.get(family.type, [""]))
    return sampled, declared


def unexported(names: Iterable[str], sampled: set[str], declared: set[str]) -> set[str]:
    """The referenced names no service exports: without a sample, except the fault-only ones, which
    need only be declared."""
    return {
        name
        for name in names
        if name not in sampled and not (name in ONLY_AFTER_A_FAULT and name in declared)
    }


# --- Reading PromQL: checked first, since every other check relies on it. -------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.99, sum by (le) (rate(a_bucket{le="1", job=~"x|y"}[$__rate_interval])))',
            {"a_bucket"},
        ),
        ("sum(rate(a_total[5m])) by (job) / on(job) group_left(instance) b", {"a_total", "b"}),
        ("(sum(a) or on() vector(0)) == 0 and on() count(b) > 5e9", {"a", "b"}),
        ("max(a offset 1h30m) - max_over_time(b[15m:1m]) < bool 1.5e-3", {"a", "b"}),
        ('label_replace(max(a), "alarm", "memory", "", "") or c{__name__="d"}', {"a", "c", "d"}),
        ("Inf > NaN unless x:recorded:rate5m", {"x:recorded:rate5m"}),
    ],
)
def test_metric_names_are_read_out_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_an_unknown_function_is_refused_not_taken_for_a_metric() -> None:
    with pytest.raises(ValueError, match="rates"):
        metric_names("sum(rates(a_total[5m]))")


def test_a_made_up_or_misspelt_metric_is_reported_missing() -> None:
    exposition = (
        "# TYPE hookline_delivery_attempts counter\n"
        'hookline_delivery_attempts_total{outcome="success"} 3\n'
        "# TYPE hookline_loop_restarts counter\n"
    )
    sampled, declared = declared_names(exposition)
    names = referenced(
        [
            'sum(rate(hookline_delivery_attempts_total{outcome="success"}[5m]))',
            "rate(hookline_delivery_attempts[5m])",  # the counter without _total
            "hookline_made_up_total > 0",
            "increase(hookline_loop_restarts_total[5m])",  # declared, and fault-only
            "up == 0",
        ]
    )
    assert unexported(names, sampled, declared) == {"hookline_delivery_attempts", "hookline_made_up_total"}


# --- The files as files. ----------------------------------------------------------------------------


def test_every_expression_reads_and_names_metrics() -> None:
    exprs = expressions()
    # Guards against a walk that finds nothing (and a check that passes on nothing).
    assert len(dashboard_expressions(json.loads(DASHBOARD.read_text()))) >= 30
    assert len(alert_rules()) >= 10
    for expr in exprs:
        assert metric_names(expr), f"no metric in {expr!r}"
    assert referenced(exprs) >= ONLY_AFTER_A_FAULT  # no stale exemption


def test_the_dashboard_is_a_grafana_dashboard_on_the_provisioned_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"]
    assert dashboard["title"]
    panels = [*dashboard["panels"], *(p for row in dashboard["panels"] for p in row.get("panels", []))]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["title"], panel
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        position = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= position.keys(), panel["title"]
        assert position["x"] + position["w"] <= 24, panel["title"]


def test_alert_rules_are_complete() -> None:
    loaded = yaml.safe_load(ALERTS.read_text())
    assert loaded["groups"]
    names = []
    for group in loaded["groups"]:
        assert group["name"]
        assert group["rules"], group["name"]
        for rule in group["rules"]:
            names.append(rule["alert"])
            assert re.fullmatch(r"Hookline[A-Z][A-Za-z]+", rule["alert"]), rule["alert"]
            assert isinstance(rule["expr"], str), rule["alert"]
            assert rule["expr"].strip(), rule["alert"]
            assert re.fullmatch(r"(\d+[smhd])+", rule["for"]), rule["alert"]
            assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
            annotations = rule["annotations"]
            assert annotations["summary"], rule["alert"]
            assert annotations["description"], rule["alert"]
            assert annotations["runbook"].startswith("README.md#operations"), rule["alert"]
            assert rule["alert"] in annotations["runbook"], rule["alert"]
    assert len(names) == len(set(names)), "alert names must be unique"


def test_prometheus_scrapes_each_service_on_its_port_and_loads_the_rules() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    compose = yaml.safe_load(COMPOSE.read_text())
    ports = {
        "ingest": IngestSettings.model_fields["ingest_port"].default,
        "health-monitor": MonitorSettings.model_fields["monitor_port"].default,
        "dispatcher": DispatcherSettings.model_fields["dispatcher_metrics_port"].default,
        "outbox-relay": OutboxRelaySettings.model_fields["outbox_metrics_port"].default,
    }
    targets: dict[str, set[str]] = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.setdefault(job["job_name"], set()).update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.setdefault(job["job_name"], set()).update(
                f"{name}:{dns['port']}" for name in dns["names"]
            )
    # Job names are the compose service names, which the expressions' job matchers use too.
    assert targets == {service: {f"{service}:{port}"} for service, port in ports.items()}
    assert set(targets) <= set(compose["services"])
    for expr in expressions():
        for value in re.findall(r'\bjob\s*=~?\s*"([^"]*)"', expr):
            assert set(value.split("|")) <= set(targets), f"unknown job in {expr!r}"

    prometheus = compose["services"]["prometheus"]
    mounts = bind_mounts(prometheus)
    config_path = next(
        arg.split("=", 1)[1] for arg in prometheus["command"] if arg.startswith("--config.file=")
    )
    assert mounts[config_path] == PROMETHEUS
    assert [mounts[path] for path in config["rule_files"]] == [ALERTS]


def test_prometheus_scrapes_with_the_token_compose_gives_it_as_a_file() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    compose = yaml.safe_load(COMPOSE.read_text())
    prometheus = compose["services"]["prometheus"]
    # Container path -> the top-level config compose writes there.
    files = {entry["target"]: compose["configs"][entry["source"]] for entry in prometheus.get("configs", [])}
    paths = set()
    for job in config["scrape_configs"]:
        authorization = job.get("authorization")
        assert authorization is not None, f"job {job['job_name']} sends no token: its scrapes get 401"
        # From a file only: the token itself is in no file of the repository.
        assert authorization == {"type": "Bearer", "credentials_file": authorization.get("credentials_file")}
        paths.add(authorization["credentials_file"])
    (path,) = paths
    assert path in files, f"compose gives Prometheus no file at {path}"
    # The metrics token when it is set, else the API token the services are given (same fallback).
    environments = [compose["services"][name]["environment"] for name in ("ingest", "health-monitor")]
    (api_token,) = {environment["HOOKLINE_API_TOKEN"] for environment in environments}
    assert api_token.startswith("${HOOKLINE_API_TOKEN:-")
    assert files[path]["content"] == "${HOOKLINE_METRICS_TOKEN:-" + api_token + "}"
    # Prometheus's own API answers every series it scraped without a login: this host only.
    assert all(port.startswith("127.0.0.1:") for port in prometheus["ports"])


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> file or directory of the checkout, for the service's ./ bind mounts."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            found[target] = ROOT / source
    return found


def test_the_observability_profile_provisions_grafana_with_prometheus_and_the_dashboard() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    profiled = {
        name
        for name, service in compose["services"].items()
        if "observability" in service.get("profiles", [])
    }
    assert profiled == {"prometheus", "grafana"}  # the rest of the system is not changed by it
    for name in profiled:
        for path in bind_mounts(compose["services"][name]).values():
            assert path.exists(), f"{name} mounts {path}, which does not exist"
    grafana = compose["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == ROOT / "deploy" / "grafana" / "provisioning"

    datasources = [
        source
        for path in sorted((provisioning / "datasources").glob("*.yml"))
        for source in yaml.safe_load(path.read_text())["datasources"]
    ]
    [prometheus] = [source for source in datasources if source["type"] == "prometheus"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[-1]
    assert prometheus["url"] == f"http://prometheus:{prometheus_port}"
    assert prometheus["uid"] == "prometheus"
    assert prometheus["isDefault"] is True

    providers = [
        provider
        for path in sorted((provisioning / "dashboards").glob("*.yml"))
        for provider in yaml.safe_load(path.read_text())["providers"]
    ]
    [provider] = providers
    dashboard_dir = provider["options"]["path"]
    assert mounts[f"{dashboard_dir}/hookline.json"] == DASHBOARD
    environment = grafana["environment"]
    assert environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{dashboard_dir}/hookline.json"
    # Viewing needs no login; the admin password comes from the environment, never a fixed one.
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert environment["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert environment["GF_SECURITY_ADMIN_PASSWORD"].startswith("${HOOKLINE_GRAFANA_ADMIN_PASSWORD")


# --- Against the real services. ---------------------------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    )


@pytest.fixture(scope="module")
def outbox_relay(system: System) -> Iterator[services.Service]:
    """An outbox relay beside the system, on a database of its own (its metrics are alerted on)."""
    with postgres.database("observability") as dsn:
        migrated = subprocess.run(
            [services.HOOKLINE, "outbox-relay", "--dsn", dsn, "--migrate"],
            env=system.env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert migrated.returncode == 0, migrated.stderr
        relay = services.start("outbox-relay", {**system.env, "HOOKLINE_OUTBOX_DSN": dsn}, system.log_dir)
        relay.wait_ready()
        yield relay
        assert relay.stop() == 0, relay.log()


async def scrape(system: System, *more: services.Service) -> str:
    """Every service's /metrics, concatenated: which service exports a name does not matter here."""
    every = [system.ingest, *system.dispatchers, system.monitor, *more]
    texts = []
    for service in every:
        # With the metrics token, as Prometheus scrapes (deploy/prometheus/prometheus.yml).
        async with httpx.AsyncClient(
            base_url=service.base_url, headers=bearer(METRICS_TOKEN), timeout=30
        ) as scraper:
            response = await scraper.get("/metrics")
        assert response.status_code == 200, f"{service.name}: {response.status_code} {response.text[:200]}"
        texts.append(response.text)
    return "\n".join(texts)


class Script:
    """/ok takes everything; /flaky fails each event's first arrival (a retry, then a success); /gone
    answers 400 (permanent: a dead letter)."""

    def __init__(self) -> None:
        self.flaky_arrivals: Counter[str] = Counter()

    def __call__(self, received: Received) -> Reply:
        if received.path == "/gone":
            return Reply(status=400)
        if received.path == "/flaky":
            event_id = json.loads(received.body)["id"]
            self.flaky_arrivals[event_id] += 1
            if self.flaky_arrivals[event_id] == 1:
                return Reply(status=503)
        return Reply(status=204)


async def test_every_metric_the_dashboard_and_alerts_use_is_exported(
    system: System, receiver: Receiver, outbox_relay: services.Service
) -> None:
    script = Script()
    receiver.responder = script
    acme = tenant()
    for path in ("/ok", "/flaky", "/gone"):
        # /ok capped: a queue of its own, so that the per-endpoint queue depth has a series too.
        capped = {"max_in_flight": 10} if path == "/ok" else {}
        system.add_endpoint(acme, receiver.url(path), ["order.*"], **capped)
    system.add_endpoint("canary", receiver.url("/canary"), ["hookline.canary"])
    async with client(system.ingest.base_url) as api:
        for n in range(3):
            sent = await api.post(
                "/v1/events", json={"tenant": acme, "type": "order.created", "data": {"n": n}}
            )
            assert sent.status_code == 202, sent.text

    # The traffic first: each event delivered to /ok, retried then delivered to /flaky, refused by
    # /gone (a dead letter); the canaries arriving.
    def delivered() -> bool:
        paths = Counter(r.path for r in receiver.requests)
        retried = sorted(script.flaky_arrivals.values()) == [2, 2, 2]
        return paths["/ok"] >= 3 and retried and paths["/gone"] >= 3 and paths["/canary"] >= 1

    await eventually(lambda: asyncio.sleep(0, delivered()), explain=lambda: f"{script.flaky_arrivals}")

    names = referenced(expressions())
    sampled: set[str] = set()
    declared: set[str] = set()

    async def all_exported() -> bool:
        nonlocal sampled, declared
        sampled, declared = declared_names(await scrape(system, outbox_relay))
        return not unexported(names, sampled, declared)

    # The monitor's series (breakers, queue depths, latency, alerts) follow within a few of its ticks.
    await eventually(
        all_exported,
        timeout_s=60,
        explain=lambda: f"not exported (yet): {sorted(unexported(names, sampled, declared))}",
    )

    # The check can fail: against this very scrape, a made-up metric and a counter without its
    # _total are reported missing.
    wrong = referenced([*expressions(), "hookline_made_up_total > 0", "rate(hookline_delivery_attempts[5m])"])
    assert unexported(wrong, sampled, declared) == {"hookline_made_up_total", "hookline_delivery_attempts"}


# --- /metrics needs a token; the probes do not. -----------------------------------------------------

UNAUTHORIZED = {"error": "unauthorized", "message": "a valid bearer token is required", "details": []}
WRONG_TOKEN = "wrong-token-0123456789abcdef"


def assert_refused(http: httpx.Client, service: services.Service, headers: dict[str, str]) -> None:
    refused = http.get(f"{service.base_url}/metrics", headers=headers)
    assert refused.status_code == 401, f"{service.name} with {headers}: {refused.status_code}"
    assert refused.json() == UNAUTHORIZED, service.name
    assert refused.headers["www-authenticate"] == "Bearer", service.name


def assert_scraped(http: httpx.Client, service: services.Service, headers: dict[str, str]) -> None:
    scraped = http.get(f"{service.base_url}/metrics", headers=headers)
    assert scraped.status_code == 200, f"{service.name} with {headers}: {scraped.status_code} {scraped.text}"
    assert "# TYPE hookline_" in scraped.text, service.name


def assert_probes_open(http: httpx.Client, service: services.Service) -> None:
    for probe in ("/healthz", "/readyz"):
        answer = http.get(f"{service.base_url}{probe}")
        assert answer.status_code == 200, f"{service.name} {probe}: {answer.status_code} {answer.text}"


def test_with_a_metrics_token_metrics_answer_it_and_nothing_else(system: System) -> None:
    """HOOKLINE_METRICS_TOKEN set (this module's system): every service's /metrics takes it; the
    ingest's and the monitor's take the API token too; without a token, with another or another
    scheme, 401 with the APIs' error body; the probes answer without a token."""
    refusals: list[dict[str, str]] = [
        {},
        bearer(WRONG_TOKEN),
        {"authorization": f"Basic {METRICS_TOKEN}"},
        {"authorization": METRICS_TOKEN},
    ]
    with httpx.Client(timeout=30) as http:
        for service in (system.ingest, system.monitor, *system.dispatchers):
            for headers in refusals:
                assert_refused(http, service, headers)
            assert_scraped(http, service, bearer(METRICS_TOKEN))
            assert_probes_open(http, service)
        for service in (system.ingest, system.monitor):
            assert_scraped(http, service, bearer(services.TOKEN))
        # A dispatcher is never given the API token: it reads nothing there.
        for dispatcher in system.dispatchers:
            assert_refused(http, dispatcher, bearer(services.TOKEN))


def test_without_a_metrics_token_the_api_token_reads_the_ingest_and_monitor_metrics(system: System) -> None:
    """HOOKLINE_METRICS_TOKEN unset (compose's Prometheus then sends the API token): the ingest and the
    monitor take the API token alone; a dispatcher's /metrics, which names no endpoint, stays open."""
    env = {name: value for name, value in system.env.items() if name != "HOOKLINE_METRICS_TOKEN"}
    started = [
        services.start(command, env, system.log_dir, name=f"{command}-without-metrics-token")
        for command in ("ingest", "health-monitor", "dispatcher")
    ]
    system.extra.extend(started)  # their logs go with the system's on a failure
    ingest, monitor, dispatcher = started
    try:
        for service in started:
            service.wait_ready(timeout_s=60)
        with httpx.Client(timeout=30) as http:
            for service in (ingest, monitor):
                for headers in ({}, bearer(WRONG_TOKEN), bearer(METRICS_TOKEN)):
                    assert_refused(http, service, headers)
                assert_scraped(http, service, bearer(services.TOKEN))
                assert_probes_open(http, service)
            assert_scraped(http, dispatcher, {})
            assert_probes_open(http, dispatcher)
    finally:
        # Stopped here: they serve this test only, and a third dispatcher would share later deliveries.
        codes = {service.name: service.stop() for service in started}
    assert set(codes.values()) == {0}, codes


CANARY_ENV = {
    "HOOKLINE_CANARY_INTERVAL_S": "0.5",
    "HOOKLINE_CANARY_LATE_S": "3",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000",
}


@pytest.mark.system_env(CANARY_ENV)
async def test_canaries_measure_the_whole_path_and_say_when_it_breaks(
    own_system: System, receiver: Receiver
) -> None:
    system = own_system  # the settings of its own (system_env)
    status, delay_s = 204, 0.0
    receiver.responder = lambda _: Reply(status=status, delay_s=delay_s)
    created_s = time.time()
    canary = system.add_endpoint("canary", receiver.url("/canary"), ["hookline.canary"])

    async def latency() -> float | None:
        async with httpx.AsyncClient(base_url=system.monitor.base_url, headers=AUTH, timeout=10) as client:
            response = await client.get("/metrics")
        assert response.status_code == 200, response.text
        text = response.text
        for line in text.splitlines():
            if line.startswith("hookline_canary_latency_seconds{") and canary["id"] in line:
                return float(line.rsplit(" ", 1)[1])
        return None

    measured = await eventually(latency, timeout_s=20)
    # Seconds, from a canary published after the endpoint existed to its delivery: no more than the
    # time since (a stopwatch bound would measure the machine).
    assert 0 <= measured <= time.time() - created_s
    arrived = await receiver.wait_for(2, path="/canary")
    assert all(r.headers["webhook-id"].startswith("evt_") for r in arrived)

    async def firing() -> set[str]:
        # The canary alerts only: five seconds per canary may also make the endpoint's p95 over five
        # minutes slow (slow_endpoint), which rightly lasts longer than the canaries' lateness.
        return {
            a["alert"]
            for a in await get_json(system.monitor, "/v1/alerts") or []
            if a["endpoint_id"] == canary["id"] and a["alert"].startswith("canary_")
        }

    async def fires(name: str) -> bool:
        return name in await firing()

    async def quiet() -> bool:
        return not await firing()

    status = 503
    await eventually(lambda: fires("canary_failed"), timeout_s=20)
    status = 204
    await eventually(quiet, timeout_s=20)

    delay_s = 5.0  # answered, but each canary arrives 5 s after it was sent: later than 3 s
    await eventually(lambda: fires("canary_late"), timeout_s=20)
    assert "canary_failed" not in await firing()
    delay_s = 0.0
    await eventually(quiet, timeout_s=30)


COLLECTOR_PORT = services.free_port()
# Spans are exported in batches: every half second here (5 s by default).
TRACES_ENV = {
    "HOOKLINE_OTLP_ENDPOINT": f"http://127.0.0.1:{COLLECTOR_PORT}",
    "OTEL_BSP_SCHEDULE_DELAY": "500",
}


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class Collector:
    """An OTLP/HTTP receiver of traces (protobuf), as a collector exposes on :4318/v1/traces."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            collector.spans.append(
                                Span(
                                    name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                                    parent_id=span.parent_span_id.hex(),
                                    attributes={a.key: _value(a.value) for a in span.attributes},
                                )
                            )  # fmt: skip
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", COLLECTOR_PORT), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with Collector() as running:
        yield running


def traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def deliveries(receiver: Receiver, path: str, event_id: str) -> list[Received]:
    return [r for r in receiver.requests if r.path == path and json.loads(r.body)["id"] == event_id]


@pytest.mark.system_env(TRACES_ENV)
async def test_a_posted_events_trace_reaches_the_receiver_through_hooklines_spans(
    collector: Collector, own_system: System, receiver: Receiver
) -> None:
    system = own_system  # the settings of its own (system_env)
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/traced"), ["order.*"])
    sent, trace_id, caller_span = traceparent()
    event_id = f"evt_traced_{acme}"
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}
    ) as api:
        answer = await api.post(
            "/v1/events", json={"id": event_id, "tenant": acme, "type": "order.created", "data": {}},
            headers={"traceparent": sent, "tracestate": "vendor=abc"},
        )  # fmt: skip
    assert answer.status_code == 202, answer.text
    await eventually(lambda: asyncio.sleep(0, bool(deliveries(receiver, "/traced", event_id))))
    [delivery] = deliveries(receiver, "/traced", event_id)
    version, got_trace, got_parent, flags = delivery.headers["traceparent"].split("-")
    assert (version, got_trace, flags) == ("00", trace_id, "01")
    assert delivery.headers["tracestate"] == "vendor=abc"

    def spans() -> dict[str, Span] | None:
        mine = {s.name: s for s in collector.spans if s.trace_id == trace_id}
        return mine if {"hookline.publish", "hookline.deliver"} <= set(mine) else None

    found = await eventually(lambda: asyncio.sleep(0, spans()))
    publish, deliver = found["hookline.publish"], found["hookline.deliver"]
    assert publish.parent_id == caller_span  # under the caller's span
    assert deliver.parent_id == publish.span_id
    assert got_parent == deliver.span_id  # the receiver's span will be a child of the attempt
    assert deliver.attributes["hookline.event_id"] == event_id
    assert deliver.attributes["hookline.attempt"] == 1
    assert deliver.attributes["http.response.status_code"] == 204


@pytest.mark.system_env(TRACES_ENV)
async def test_an_amqp_publishers_trace_follows_every_attempt(
    collector: Collector, own_system: System, receiver: Receiver
) -> None:
    system = own_system  # the settings of its own (system_env)
    failures = {"left": 1}

    def respond(request: Received) -> Reply:
        if request.path == "/retried" and failures["left"]:
            failures["left"] -= 1
            return Reply(status=500)
        return Reply()

    receiver.responder = respond
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/retried"), ["order.*"])
    sent, trace_id, publisher_span = traceparent()
    event_id = f"evt_amqp_traced_{acme}"
    event = {
        "id": event_id,
        "tenant": acme,
        "type": "order.created",
        "occurred_at": "2026-12-01T00:00:00Z",
        "data": {},
    }
    await publish_event(system.amqp_url, event, f"{acme}.order.created", headers={"traceparent": sent})
    await eventually(lambda: asyncio.sleep(0, len(deliveries(receiver, "/retried", event_id)) == 2))
    first, second = deliveries(receiver, "/retried", event_id)
    assert first.headers["traceparent"].split("-")[1] == trace_id
    assert second.headers["traceparent"].split("-")[1] == trace_id  # the retry kept the trace

    def attempts() -> list[Span] | None:
        mine = sorted(
            (s for s in collector.spans if s.trace_id == trace_id and s.name == "hookline.deliver"),
            key=lambda s: s.attributes["hookline.attempt"],
        )
        return mine if len(mine) == 2 else None

    one, two = await eventually(lambda: asyncio.sleep(0, attempts()))
    assert [one.attributes["http.response.status_code"], two.attributes["http.response.status_code"]] == [
        500,
        204,
    ]
    assert one.parent_id == two.parent_id == publisher_span
    assert first.headers["traceparent"].split("-")[2] == one.span_id
    assert second.headers["traceparent"].split("-")[2] == two.span_id
