"""deploy/kubernetes describes a system the real services accept.

Every ``HOOKLINE_*`` variable a workload sets (literal ``env``, ConfigMap and Secret keys, ``envFrom``)
is a setting of that service's settings class, so a typo or a removed setting fails here instead of
being silently ignored by pydantic-settings (``extra="ignore"``); required settings are provided; the
values build the settings class; ports, probes and scrape annotations agree with the port settings
(and only the dispatcher, whose /metrics needs no token, is annotated for scraping); each workload runs
its own ``hookline <service>``; pods outlive the shutdown grace; and the checker is shown to catch what
it is meant to catch (the self-checks at the end run it on altered documents).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import yaml
from pydantic import AliasChoices, AliasPath
from pydantic_settings import BaseSettings

from hookline.shared.cli import build_parser
from hookline.shared.settings import DispatcherSettings, IngestSettings, MonitorSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
NAMESPACE = "hookline"

Doc = dict[str, Any]

# app.kubernetes.io/component -> the settings class of the service it runs
SETTINGS: dict[str, type[BaseSettings]] = {
    "ingest": IngestSettings,
    "dispatcher": DispatcherSettings,
    "health-monitor": MonitorSettings,
}
LISTEN = {  # the (host, port) settings a service listens on; probes and metrics are on that port
    "ingest": ("HOOKLINE_INGEST_HOST", "HOOKLINE_INGEST_PORT"),
    "dispatcher": ("HOOKLINE_DISPATCHER_METRICS_HOST", "HOOKLINE_DISPATCHER_METRICS_PORT"),
    "health-monitor": ("HOOKLINE_MONITOR_HOST", "HOOKLINE_MONITOR_PORT"),
}
# Secrets the manifests use but do not contain: the RabbitMQ Cluster Operator creates this one.
EXTERNAL_SECRETS = {"hookline-rabbitmq-default-user": {"username", "password", "host", "port"}}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
# Services whose /metrics answers only a bearer token: prometheus.io/* annotations cannot send one, so
# these are scraped by a PodMonitor (README.md there) and must not be annotated (every scrape a 401).
TOKEN_SCRAPED = {"ingest", "health-monitor"}
SECRET = object()  # the value of a variable that comes from a Secret: known to exist, not known


# --- reading the manifests -------------------------------------------------------------------------


def load_documents() -> dict[str, list[Doc]]:
    """Every YAML file here (kustomization.yaml included), each as its list of documents."""
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted(DEPLOY.glob("*.yaml"))
    }


def resources(files: dict[str, list[Doc]]) -> list[Doc]:
    return [doc for name, docs in files.items() if name != "kustomization.yaml" for doc in docs]


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def workloads(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """(service, workload) for every hookline Deployment and StatefulSet."""
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            yield doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"], doc


def containers(workload: Doc) -> list[Doc]:
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def secret_keys(secret: Doc) -> set[str]:
    return set(secret.get("data") or {}) | set(secret.get("stringData") or {})


def env_names(cls: type[BaseSettings]) -> dict[str, str]:
    """Environment variable (upper case) -> field, for every field of a settings class, aliases respected."""
    prefix = cls.model_config.get("env_prefix", "")
    names: dict[str, str] = {}
    for field_name, field in cls.model_fields.items():
        alias = field.validation_alias or field.alias
        if isinstance(alias, str):
            names[alias.upper()] = field_name
        elif isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str):
                    names[choice.upper()] = field_name
        elif isinstance(alias, AliasPath):
            names[str(alias.path[0]).upper()] = field_name
        else:
            names[f"{prefix}{field_name}".upper()] = field_name
    return names


def required_env_names(cls: type[BaseSettings]) -> set[str]:
    return {env for env, field in env_names(cls).items() if cls.model_fields[field].is_required()}


def default(cls: type[BaseSettings], env: str) -> Any:
    return cls.model_fields[env_names(cls)[env]].default


def container_env(container: Doc, docs: list[Doc]) -> tuple[dict[str, Any], list[str]]:
    """The container's environment as Kubernetes builds it (envFrom, then env; later wins; $(VAR)
    expanded), each value a string or SECRET, and the problems found on the way (missing sources)."""
    configmaps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    env: dict[str, Any] = {}
    problems: list[str] = []
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            if name not in configmaps:
                problems.append(f"envFrom names ConfigMap {name}, which is not in the manifests")
                continue
            env.update({prefix + k: str(v) for k, v in (configmaps[name].get("data") or {}).items()})
        if "secretRef" in source:
            name = source["secretRef"]["name"]
            keys = secret_keys(secrets[name]) if name in secrets else EXTERNAL_SECRETS.get(name)
            if keys is None:
                problems.append(f"envFrom names Secret {name}, which is not in the manifests")
                continue
            env.update(dict.fromkeys((prefix + key for key in keys), SECRET))
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = _expand(str(entry["value"]), env)
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            keys = (
                secret_keys(secrets[ref["name"]])
                if ref["name"] in secrets
                else EXTERNAL_SECRETS.get(ref["name"])
            )
            # An optional key may be missing (the variable is then unset); when added, it is a secret.
            if (keys is None or ref["key"] not in keys) and not ref.get("optional"):
                problems.append(f"{name} reads {ref['name']}/{ref['key']}, which no Secret provides")
            env[name] = SECRET
        elif "configMapKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["configMapKeyRef"]
            data = (configmaps.get(ref["name"]) or {}).get("data") or {}
            if ref["key"] not in data:
                problems.append(f"{name} reads {ref['name']}/{ref['key']}, which no ConfigMap provides")
            env[name] = str(data.get(ref["key"], ""))
        else:
            env[name] = SECRET  # fieldRef and the like: set at run time
    return env, problems


def _expand(value: str, env: dict[str, Any]) -> Any:
    """Kubernetes' $(VAR) expansion of the variables defined before; a value built from a secret stays
    a _Template, which settings_environment fills with stand-ins so that its shape is still validated."""
    if any(env.get(name) is SECRET for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value)):
        return _Template(value)
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: str(env.get(m.group(1), m.group(0))), value)


class _Template(str):
    """A value built from secrets by $(VAR) expansion: its shape is known, its secrets are not."""

    __slots__ = ()


def settings_environment(env: dict[str, Any]) -> dict[str, str]:
    """The HOOKLINE_* variables with stand-ins for secrets, to build a settings class from."""
    stand_in = "s3cr3t-stand-in-value-0123456789abcdef"
    resolved: dict[str, str] = {}
    for name, value in env.items():
        if value is SECRET:
            value = stand_in
        elif isinstance(value, _Template):
            value = re.sub(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", stand_in, value)
        if name.startswith("HOOKLINE_"):
            resolved[name] = value
    return resolved


def listen_port(service: str, env: dict[str, Any]) -> int:
    port = env.get(LISTEN[service][1])
    return int(port) if isinstance(port, str) else int(default(SETTINGS[service], LISTEN[service][1]))


# --- the checks (each returns what is wrong; the tests assert nothing is) --------------------------


def env_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    for service, workload in workloads(docs):
        cls = SETTINGS.get(service)
        where = f"{workload['kind']} {workload['metadata']['name']}"
        if cls is None:
            problems.append(f"{where}: component {service!r} is not a hookline service")
            continue
        known = env_names(cls)
        for container in containers(workload):
            env, found = container_env(container, docs)
            problems += [f"{where}: {p}" for p in found]
            for name in sorted(env):
                if name.upper().startswith("HOOKLINE_") and name.upper() not in known:
                    problems.append(f"{where}: {name} is not a setting of {cls.__name__}")
            for name in sorted(required_env_names(cls) - {n.upper() for n in env}):
                problems.append(f"{where}: required setting {name} is not provided")
    return problems


def command_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    for service, workload in workloads(docs):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        argv = [*container.get("command", []), *container.get("args", [])]
        if argv != ["hookline", service]:
            problems.append(f"{workload['metadata']['name']} runs {argv}, not ['hookline', {service!r}]")
    return problems


def port_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    for service, workload in workloads(docs):
        name = workload["metadata"]["name"]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env, _ = container_env(container, docs)
        port = listen_port(service, env)
        named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        if port not in named.values():
            problems.append(
                f"{name}: listens on {port} ({LISTEN[service][1]}) but exposes {sorted(named.values())}"
            )
        if env.get(LISTEN[service][0]) != "0.0.0.0":
            problems.append(f"{name}: {LISTEN[service][0]} must be 0.0.0.0 in a pod")
        problems += [f"{name}: {problem}" for problem in probe_problems(container, named, port)]
        annotations = workload["spec"]["template"]["metadata"].get("annotations") or {}
        scraped = annotations.get("prometheus.io/scrape") == "true"
        if service in TOKEN_SCRAPED:
            if scraped:
                problems.append(f"{name}: annotated for scraping, but its /metrics needs a bearer token")
            if env.get("HOOKLINE_METRICS_TOKEN") is not SECRET:
                problems.append(f"{name}: HOOKLINE_METRICS_TOKEN does not come from a Secret")
        elif not scraped or annotations.get("prometheus.io/port") != str(port):
            problems.append(f"{name}: prometheus.io annotations do not point at port {port}")
    return problems + service_port_problems(docs)


def probe_problems(container: Doc, named: dict[str | None, int], port: int) -> list[str]:
    problems: list[str] = []
    expected_paths = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": None}
    for probe, path in expected_paths.items():
        if probe not in container:
            if path is not None:
                problems.append(f"no {probe}")
            continue
        target = container[probe]["httpGet"]["port"]
        if named.get(target, target) != port:
            problems.append(f"{probe} port {target} is not the service's port {port}")
        if path is not None and container[probe]["httpGet"]["path"] != path:
            problems.append(f"{probe} should ask {path}")
    return problems


def service_port_problems(docs: list[Doc]) -> list[str]:
    """Each Service selects a hookline workload and targets one of its container ports."""
    problems: list[str] = []
    for service_doc in by_kind(docs, "Service").values():
        name, selector = service_doc["metadata"]["name"], service_doc["spec"]["selector"]
        matched = [
            w
            for _, w in workloads(docs)
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        if not matched:
            problems.append(f"Service {name} selects no workload")
        for workload in matched:
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            ports = {p.get("name") for p in container["ports"]} | {
                p["containerPort"] for p in container["ports"]
            }
            for port_doc in service_doc["spec"]["ports"]:
                if port_doc.get("targetPort", port_doc["port"]) not in ports:
                    problems.append(
                        f"Service {name}: targetPort {port_doc.get('targetPort')} is not a port of "
                        f"{workload['metadata']['name']}"
                    )
    return problems


def lifecycle_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    for service, workload in workloads(docs):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env, _ = container_env(container, docs)
        grace = env.get("HOOKLINE_SHUTDOWN_GRACE_S")
        grace_s = (
            float(grace)
            if isinstance(grace, str)
            else float(default(SETTINGS[service], "HOOKLINE_SHUTDOWN_GRACE_S"))
        )
        # The kubelet's default is 30 s; an unset field counts as that.
        if pod.get("terminationGracePeriodSeconds", 30) <= grace_s:
            problems.append(
                f"{name}: terminationGracePeriodSeconds {pod.get('terminationGracePeriodSeconds', 30)} "
                f"does not exceed HOOKLINE_SHUTDOWN_GRACE_S {grace_s:g}"
            )
    replicas = {service: w["spec"].get("replicas") for service, w in workloads(docs)}
    if replicas.get("health-monitor") != 2:
        problems.append(
            f"the health monitor runs {replicas.get('health-monitor')} replicas, not 2 (leader + standby)"
        )
    if replicas.get("ingest") != 2:
        problems.append(f"the ingest runs {replicas.get('ingest')} replicas, not 2")
    if set(replicas) != set(SETTINGS):
        problems.append(f"workloads for {sorted(replicas)}, expected {sorted(SETTINGS)}")
    return problems


def security_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    for _, workload in workloads(docs):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        if (pod.get("securityContext") or {}).get("runAsNonRoot") is not True:
            problems.append(f"{name}: the pod's securityContext lacks runAsNonRoot: true")
        for container in containers(workload):
            context = container.get("securityContext") or {}
            where = f"{name}/{container['name']}"
            if context.get("runAsNonRoot") is not True:
                problems.append(f"{where}: runAsNonRoot is not true")
            if context.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: the root filesystem is writable")
            if context.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: privilege escalation is allowed")
            if "ALL" not in ((context.get("capabilities") or {}).get("drop") or []):
                problems.append(f"{where}: capabilities are not all dropped")
            for kind in ("requests", "limits"):
                if not {"cpu", "memory"} <= set((container.get("resources") or {}).get(kind) or {}):
                    problems.append(f"{where}: no cpu and memory {kind}")
    return problems


def broker_problems(docs: list[Doc]) -> list[str]:
    """One AMQP URL for all, listing exactly the nodes of the RabbitmqCluster."""
    problems: list[str] = []
    (cluster,) = by_kind(docs, "RabbitmqCluster").values()
    name, replicas = cluster["metadata"]["name"], cluster["spec"]["replicas"]
    if replicas != 3:
        problems.append(f"the broker has {replicas} nodes, not 3")
    expected = [f"{name}-server-{i}.{name}-nodes:5672" for i in range(replicas)]
    urls: set[str] = set()
    for _, workload in workloads(docs):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env, _ = container_env(container, docs)
        url = str(env.get("HOOKLINE_AMQP_URL", ""))
        urls.add(url)
        hosts = [part.rsplit("@", 1)[-1].split("/", 1)[0] for part in url.split(",")]
        if hosts != expected:
            problems.append(
                f"{workload['metadata']['name']}: HOOKLINE_AMQP_URL lists {hosts}, not {expected}"
            )
    if len(urls) != 1:
        problems.append("the services do not share one HOOKLINE_AMQP_URL")
    return problems


# --- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files() -> dict[str, list[Doc]]:
    return load_documents()


@pytest.fixture(scope="module")
def docs(files: dict[str, list[Doc]]) -> list[Doc]:
    return resources(files)


def test_every_file_parses_and_the_kustomization_lists_exactly_them(files: dict[str, list[Doc]]) -> None:
    assert "kustomization.yaml" in files
    (kustomization,) = files["kustomization.yaml"]
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    assert set(listed) == set(files) - {"kustomization.yaml"}
    assert not [p.name for p in DEPLOY.iterdir() if p.suffix == ".yml"], "use .yaml"
    for name, documents in files.items():
        assert documents, f"{name} is empty"


def test_every_resource_is_named_and_in_the_hookline_namespace(docs: list[Doc]) -> None:
    for doc in docs:
        assert doc.get("apiVersion"), doc
        assert doc.get("kind"), doc
        assert doc["metadata"].get("name"), doc
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]
    assert set(by_kind(docs, "Namespace")) == {NAMESPACE}
    kinds = {doc["kind"] for doc in docs}
    assert {"Secret", "ConfigMap", "RabbitmqCluster", "PodDisruptionBudget", "ScaledObject"} <= kinds
    (cluster,) = by_kind(docs, "RabbitmqCluster").values()
    assert cluster["apiVersion"] == "rabbitmq.com/v1beta1"


def test_every_hookline_variable_is_a_setting_of_its_service(docs: list[Doc]) -> None:
    assert env_problems(docs) == []


def test_the_values_build_each_service_settings(docs: list[Doc], monkeypatch: pytest.MonkeyPatch) -> None:
    for service, workload in workloads(docs):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env, _ = container_env(container, docs)
        for name in [n for n in os.environ if n.upper().startswith("HOOKLINE_")]:
            monkeypatch.delenv(name)
        for name, value in settings_environment(env).items():
            monkeypatch.setenv(name, value)
        SETTINGS[service]()  # raises ValidationError naming a bad value


def test_workloads_run_their_own_service(docs: list[Doc]) -> None:
    assert command_problems(docs) == []
    parser = build_parser()
    for service in SETTINGS:
        parser.parse_args([service])  # a real subcommand (exits 2 otherwise)


def test_ports_probes_and_scrape_annotations_match_the_port_settings(docs: list[Doc]) -> None:
    assert port_problems(docs) == []


def test_pods_outlive_the_shutdown_grace_and_replicas_are_as_designed(docs: list[Doc]) -> None:
    assert lifecycle_problems(docs) == []
    (dispatcher,) = (w for s, w in workloads(docs) if s == "dispatcher")
    assert "replicas" not in dispatcher["spec"], "the ScaledObject owns the dispatcher's replica count"


def test_pods_run_as_non_root_read_only_without_capabilities(docs: list[Doc]) -> None:
    assert security_problems(docs) == []


def test_services_reach_every_broker_node(docs: list[Doc]) -> None:
    assert broker_problems(docs) == []


def test_every_workload_has_a_disruption_budget(docs: list[Doc]) -> None:
    budgets = [
        doc["spec"]["selector"]["matchLabels"] for doc in by_kind(docs, "PodDisruptionBudget").values()
    ]
    for _, workload in workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert any(selector.items() <= labels.items() for selector in budgets), workload["metadata"]["name"]
    (cluster_name,) = by_kind(docs, "RabbitmqCluster")
    assert {"app.kubernetes.io/name": cluster_name, "app.kubernetes.io/component": "rabbitmq"} in budgets


def test_the_dispatcher_scales_on_metrics_the_monitor_exports(docs: list[Doc]) -> None:
    import hookline.health_monitor.monitor  # noqa: F401  (registers the monitor's metrics)

    (scaled,) = by_kind(docs, "ScaledObject").values()
    deployments = by_kind(docs, "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] in deployments
    exported = {metric.name for metric in prometheus_client.REGISTRY.collect()}
    for trigger in scaled["spec"]["triggers"]:
        if trigger["type"] == "prometheus":
            used = set(re.findall(r"\bhookline_[a-z0-9_]+", trigger["metadata"]["query"]))
            assert used, trigger["metadata"]["query"]
            assert used <= exported, used - exported
    assert scaled["spec"]["minReplicaCount"] >= 2


def test_the_secret_holds_placeholders_the_services_refuse(docs: list[Doc]) -> None:
    secret = by_kind(docs, "Secret")["hookline-secrets"]
    values = secret["stringData"]
    assert set(values) == {"HOOKLINE_API_TOKEN", "HOOKLINE_SECRET_KEY"}
    # Shorter than the 16 characters required: a forgotten placeholder stops the service at start.
    assert len(values["HOOKLINE_API_TOKEN"]) < 16


# --- the checker catches what it should ------------------------------------------------------------


def _workload(docs: list[Doc], service: str) -> Doc:
    (workload,) = (w for s, w in workloads(docs) if s == service)
    return workload


def _env(docs: list[Doc], service: str, name: str) -> Doc:
    (container,) = _workload(docs, service)["spec"]["template"]["spec"]["containers"]
    entries: list[Doc] = [e for e in container["env"] if e["name"] == name]
    (entry,) = entries
    return entry


def _misspell_literal(docs: list[Doc]) -> None:
    _env(docs, "ingest", "HOOKLINE_INGEST_PORT")["name"] = "HOOKLINE_INGEST_PROT"


def _misspell_configmap_key(docs: list[Doc]) -> None:
    data = by_kind(docs, "ConfigMap")["hookline-common"]["data"]
    data["HOOKLINE_SHUTDOWN_GRACE"] = data.pop("HOOKLINE_SHUTDOWN_GRACE_S")


def _setting_of_another_service(docs: list[Doc]) -> None:
    (container,) = _workload(docs, "dispatcher")["spec"]["template"]["spec"]["containers"]
    container["env"].append({"name": "HOOKLINE_TENANT_TOKENS", "value": "a:b"})


def _drop_api_token(docs: list[Doc]) -> None:
    (container,) = _workload(docs, "health-monitor")["spec"]["template"]["spec"]["containers"]
    container["env"] = [e for e in container["env"] if e["name"] != "HOOKLINE_API_TOKEN"]


def _move_port(docs: list[Doc]) -> None:
    _env(docs, "health-monitor", "HOOKLINE_MONITOR_PORT")["value"] = "9001"


def _short_grace(docs: list[Doc]) -> None:
    _workload(docs, "dispatcher")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 20


def _wrong_command(docs: list[Doc]) -> None:
    _workload(docs, "dispatcher")["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "hookline",
        "ingest",
    ]


def _one_monitor(docs: list[Doc]) -> None:
    _workload(docs, "health-monitor")["spec"]["replicas"] = 1


def _root(docs: list[Doc]) -> None:
    _workload(docs, "ingest")["spec"]["template"]["spec"]["containers"][0]["securityContext"][
        "runAsNonRoot"
    ] = False


def _annotate_the_monitor(docs: list[Doc]) -> None:
    _workload(docs, "health-monitor")["spec"]["template"]["metadata"]["annotations"] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8001",
    }


def _metrics_token_in_plain_text(docs: list[Doc]) -> None:
    entry = _env(docs, "ingest", "HOOKLINE_METRICS_TOKEN")
    del entry["valueFrom"]
    entry["value"] = "metrics-token-0123456789abcdef"


def _forget_a_node(docs: list[Doc]) -> None:
    entry = _env(docs, "dispatcher", "HOOKLINE_AMQP_URL")
    entry["value"] = ",".join(entry["value"].split(",")[:2])


MUTATIONS: list[tuple[Callable[[list[Doc]], None], Callable[[list[Doc]], list[str]], str]] = [
    (_misspell_literal, env_problems, "HOOKLINE_INGEST_PROT is not a setting of IngestSettings"),
    (_misspell_configmap_key, env_problems, "HOOKLINE_SHUTDOWN_GRACE is not a setting of DispatcherSettings"),
    (
        _setting_of_another_service,
        env_problems,
        "HOOKLINE_TENANT_TOKENS is not a setting of DispatcherSettings",
    ),
    (_drop_api_token, env_problems, "required setting HOOKLINE_API_TOKEN is not provided"),
    (_move_port, port_problems, "listens on 9001"),
    (_annotate_the_monitor, port_problems, "its /metrics needs a bearer token"),
    (_metrics_token_in_plain_text, port_problems, "HOOKLINE_METRICS_TOKEN does not come from a Secret"),
    (_short_grace, lifecycle_problems, "does not exceed HOOKLINE_SHUTDOWN_GRACE_S 20"),
    (_wrong_command, command_problems, "not ['hookline', 'dispatcher']"),
    (_one_monitor, lifecycle_problems, "runs 1 replicas, not 2"),
    (_root, security_problems, "runAsNonRoot is not true"),
    (_forget_a_node, broker_problems, "HOOKLINE_AMQP_URL lists"),
]


@pytest.mark.parametrize(
    ("mutate", "check", "expected"), MUTATIONS, ids=[m[0].__name__.strip("_") for m in MUTATIONS]
)
def test_the_checker_catches_a_broken_manifest(
    docs: list[Doc],
    mutate: Callable[[list[Doc]], None],
    check: Callable[[list[Doc]], list[str]],
    expected: str,
) -> None:
    assert check(docs) == []
    broken = copy.deepcopy(docs)
    mutate(broken)
    found = check(broken)
    assert any(expected in problem for problem in found), found
