"""deploy/kubernetes describes a system the real services accept.

Every ``HOOKLINE_*`` variable a workload sets (literal ``env``, ConfigMap and Secret keys, ``envFrom``)
is a setting of that service's settings class, so a typo or a removed setting fails here instead of
being silently ignored by pydantic-settings (``extra="ignore"``); required settings are provided; the
values build the settings class; ports, probes and scrape annotations agree with the port settings
(and only the dispatcher, whose /metrics needs no token, is annotated for scraping); each workload runs
its own ``hookline <service>``; pods outlive the shutdown grace; the broker-setup Job runs a
``hookline broker-setup`` the CLI accepts, as the operator's administrator, with a password for exactly
the users it creates, and each service connects as its own role's user with the password the Job set
(the administrator's Secret is the Job's alone); and the checker is shown to catch what it is meant to
catch (the self-checks at the end run it on altered documents).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import prometheus_client
import pytest
import yaml
from pydantic import AliasChoices, AliasPath, ValidationError
from pydantic_settings import BaseSettings

from hookline.cli.brokersetup import MIN_PASSWORD_LENGTH, Upstream, password_variable, wanted_users
from hookline.cli.main import build_parser
from hookline.dispatcher.settings import DispatcherSettings
from hookline.health_monitor.settings import MonitorSettings
from hookline.ingest.settings import IngestSettings
from hookline.shared.broker.permissions import USERS, Role

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
# app.kubernetes.io/component -> the role whose broker user the service connects as
ROLES = {"ingest": Role.INGEST, "dispatcher": Role.DISPATCHER, "health-monitor": Role.MONITOR}
# The broker's administrator, which the RabbitMQ Cluster Operator creates: the broker-setup Job's alone.
ADMIN_SECRET = "hookline-rabbitmq-default-user"
# Secrets the manifests use but do not contain.
EXTERNAL_SECRETS = {ADMIN_SECRET: {"username", "password", "host", "port"}}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
SETUP = "broker-setup"  # the component of the Job that creates the broker users
# What `hookline broker-setup` reads besides the users' passwords: the vhost of HOOKLINE_AMQP_URL.
SETUP_VARIABLES = {"HOOKLINE_AMQP_URL"}
# The management API's port on the RabbitmqCluster's client Service.
MANAGEMENT_PORT = 15672
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


def pod_templates(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """(component, resource) for everything that runs pods: the services' workloads, then the Jobs."""
    yield from workloads(docs)
    for doc in docs:
        if doc["kind"] == "Job":
            yield doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"], doc


def setup_jobs(docs: list[Doc]) -> list[Doc]:
    return [resource for component, resource in pod_templates(docs) if component == SETUP]


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


_REFERENCE = r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)"


def _expand(value: str, env: dict[str, Any]) -> Any:
    """Kubernetes' $(VAR) expansion of the variables defined before. A secret's reference is left as is,
    so a value built from one is a _Template (settings_environment fills in stand-ins, so that its shape
    is still validated) whose other parts, a user name, are known."""
    referenced = [env.get(name) for name in re.findall(_REFERENCE, value)]

    def one(match: re.Match[str]) -> str:
        found = env.get(match.group(1))
        return match.group(0) if found is None or found is SECRET else str(found)

    expanded = re.sub(_REFERENCE, one, value)
    if any(found is SECRET or isinstance(found, _Template) for found in referenced):
        return _Template(expanded)
    return expanded


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
            value = re.sub(_REFERENCE, stand_in, value)
        if name.startswith("HOOKLINE_"):
            resolved[name] = value
    return resolved


def secret_source(container: Doc, variable: str, *, before: str | None = None) -> tuple[str, str] | None:
    """(Secret, key) a variable is read from by a secretKeyRef that cannot be missing, defined before
    the variable ``before`` (Kubernetes expands only those), or None."""
    source = None
    for entry in container.get("env", []):
        if entry["name"] == before:
            break
        if entry["name"] == variable:
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            source = None if ref is None or ref.get("optional") else (ref["name"], ref["key"])
    return source


def references(value: Any, name: str) -> bool:
    """Whether ``name`` is a value anywhere in this (a Secret named by a secretKeyRef, envFrom, volume)."""
    if isinstance(value, dict):
        return any(references(v, name) for v in value.values())
    if isinstance(value, list):
        return any(references(v, name) for v in value)
    return value == name


def setup_arguments(container: Doc) -> argparse.Namespace | None:
    """The container's command as the CLI parses it, if it is a `hookline broker-setup` it accepts."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:1] != ["hookline"]:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = build_parser().parse_args(argv[1:])
        for text in args.upstream:
            Upstream.parse(text)  # as the CLI does before anything else
    except (SystemExit, ValidationError):
        return None
    return args if args.command == "broker-setup" else None


def setup_users(args: argparse.Namespace) -> list[str]:
    """The users this broker-setup creates (each role's, then each --upstream)."""
    return [w.user for w in wanted_users([Upstream.parse(text) for text in args.upstream])]


def vhost_of(url: str) -> str:
    """The vhost a service connects to (hookline.shared.broker.amqp.Broker) or broker-setup grants on."""
    return urlsplit(url.split(",")[0].strip()).path.lstrip("/") or "/"


def listen_port(service: str, env: dict[str, Any]) -> int:
    port = env.get(LISTEN[service][1])
    return int(port) if isinstance(port, str) else int(default(SETTINGS[service], LISTEN[service][1]))


# --- the checks (each returns what is wrong; the tests assert nothing is) --------------------------


def expected_variables(component: str, resource: Doc) -> tuple[set[str], set[str], str] | None:
    """The HOOKLINE_* variables a component reads, those it needs, and what reads them; None for a
    component hookline does not have."""
    if component == SETUP:
        # Not a service: `hookline broker-setup` reads the vhost and a password per user it creates; a
        # user without one would get a generated password that no service has.
        (container,) = resource["spec"]["template"]["spec"]["containers"]
        args = setup_arguments(container)
        passwords = set() if args is None else {password_variable(user) for user in setup_users(args)}
        return SETUP_VARIABLES | passwords, passwords, "hookline broker-setup"
    cls = SETTINGS.get(component)
    if cls is None:
        return None
    return set(env_names(cls)), required_env_names(cls), cls.__name__


def env_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    for component, resource in pod_templates(docs):
        where = f"{resource['kind']} {resource['metadata']['name']}"
        expected = expected_variables(component, resource)
        if expected is None:
            problems.append(f"{where}: component {component!r} is not a hookline service")
            continue
        known, required, reader = expected
        for container in containers(resource):
            env, found = container_env(container, docs)
            problems += [f"{where}: {p}" for p in found]
            for name in sorted(env):
                if name.upper().startswith("HOOKLINE_") and name.upper() not in known:
                    problems.append(f"{where}: {name} is not a setting of {reader}")
            for name in sorted(required - {n.upper() for n in env}):
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
    for _, workload in pod_templates(docs):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        if (pod.get("securityContext") or {}).get("runAsNonRoot") is not True:
            problems.append(f"{name}: the pod's securityContext lacks runAsNonRoot: true")
        if ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            problems.append(f"{name}: the pod's seccompProfile is not RuntimeDefault")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: mounts a service account token it has no use for")
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
    """One AMQP URL for all but for the credentials, listing exactly the nodes of the RabbitmqCluster."""
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
        urls.add(re.sub(r"://[^@/,]*@", "://", url))
        hosts = [part.rsplit("@", 1)[-1].split("/", 1)[0] for part in url.split(",")]
        if hosts != expected:
            problems.append(
                f"{workload['metadata']['name']}: HOOKLINE_AMQP_URL lists {hosts}, not {expected}"
            )
    if len(urls) != 1:
        problems.append("the services do not share one HOOKLINE_AMQP_URL (their credentials aside)")
    return problems


def setup_job_problems(docs: list[Doc]) -> list[str]:
    """One broker-setup Job: a command the CLI accepts, through the management API as the operator's
    administrator, a password from a Secret for each user it creates, the services' vhost and image,
    and the retries and clean-up the first apply and re-runs need (broker-setup.yaml)."""
    jobs = setup_jobs(docs)
    if len(jobs) != 1:
        return [f"{len(jobs)} broker-setup Jobs, not 1"]
    (job,) = jobs
    name = job["metadata"]["name"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = setup_arguments(container)
    if args is None:
        argv = [*container.get("command", []), *container.get("args", [])]
        return [f"{name} runs {argv}, not a `hookline broker-setup` the CLI accepts"]
    env, _ = container_env(container, docs)
    problems = _admin_problems(name, args, container, docs)
    for user in setup_users(args):
        variable = password_variable(user)
        if variable not in env:
            problems.append(f"{name}: no {variable}: broker-setup would generate a password no service has")
        elif secret_source(container, variable) is None:
            problems.append(f"{name}: {variable} is not read from a Secret by a secretKeyRef that must exist")
    vhost = args.vhost or vhost_of(str(env.get("HOOKLINE_AMQP_URL", "amqp://localhost:5672/")))
    for _, workload in workloads(docs):
        (service,) = workload["spec"]["template"]["spec"]["containers"]
        service_vhost = vhost_of(str(container_env(service, docs)[0].get("HOOKLINE_AMQP_URL", "")))
        if service_vhost != vhost:
            problems.append(
                f"{name} grants on vhost {vhost!r}, {workload['metadata']['name']} uses {service_vhost!r}"
            )
        # An older image would grant an older permission matrix.
        if service["image"] != container["image"]:
            problems.append(
                f"{name} runs {container['image']}, {workload['metadata']['name']} {service['image']}"
            )
    return problems + _job_lifecycle_problems(job)


def _admin_problems(name: str, args: argparse.Namespace, container: Doc, docs: list[Doc]) -> list[str]:
    """--management-url: the RabbitmqCluster's Service, as the administrator from the operator's Secret."""
    if not args.management_url:
        return [f"{name}: no --management-url (the image has no rabbitmqctl)"]
    (cluster,) = by_kind(docs, "RabbitmqCluster")
    expected = f"http://$(U):$(P)@{cluster}:{MANAGEMENT_PORT}"
    match = re.fullmatch(rf"http://{_REFERENCE}:{_REFERENCE}@([^/]+)/?", args.management_url)
    if match is None or match.group(3) != f"{cluster}:{MANAGEMENT_PORT}":
        return [f"{name}: --management-url {args.management_url} is not {expected}"]
    problems = []
    for variable, key in ((match.group(1), "username"), (match.group(2), "password")):
        if secret_source(container, variable) != (ADMIN_SECRET, key):
            problems.append(f"{name}: --management-url's {key} $({variable}) is not {ADMIN_SECRET}/{key}")
    return problems


def _job_lifecycle_problems(job: Doc) -> list[str]:
    name, spec = job["metadata"]["name"], job["spec"]
    problems = []
    # The broker is not answering yet on the first apply: failures must be retried, not end the Job.
    if (
        spec["template"]["spec"].get("restartPolicy") not in ("Never", "OnFailure")
        or spec.get("backoffLimit", 6) < 1
    ):
        problems.append(f"{name}: a failed attempt is not retried")
    for rule in (spec.get("podFailurePolicy") or {}).get("rules", []):
        codes = rule.get("onExitCodes") or {}
        if rule["action"] == "FailJob" and codes.get("operator") == "In" and 1 in codes.get("values", []):
            problems.append(f"{name}: exit 1 (the broker not reachable yet) fails the Job instead of a retry")
    # Without it the finished Job stays, and an apply with a changed one fails (a Job is immutable).
    if "ttlSecondsAfterFinished" not in spec:
        problems.append(f"{name}: no ttlSecondsAfterFinished, so it is never run again by an apply")
    return problems


def credentials_problems(docs: list[Doc]) -> list[str]:
    """Each service connects as its own role's user (USERS) with the password the Job sets for that
    user, to the management API too (a user with the monitoring tag), and none uses the administrator."""
    jobs = setup_jobs(docs)
    problems = [
        f"{resource['metadata']['name']} uses {ADMIN_SECRET}: the broker-setup Job's alone"
        for _, resource in pod_templates(docs)
        if resource not in jobs and references(resource["spec"]["template"], ADMIN_SECRET)
    ]
    passwords: dict[str, tuple[str, str] | None] = {}
    for job in jobs:
        (setup,) = job["spec"]["template"]["spec"]["containers"]
        passwords.update({user: secret_source(setup, password_variable(user)) for user in USERS.values()})
    tags = {w.user: w.tags for w in wanted_users(())}
    for service, workload in workloads(docs):
        name, user = workload["metadata"]["name"], USERS[ROLES[service]]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env, _ = container_env(container, docs)
        for variable in ("HOOKLINE_AMQP_URL", "HOOKLINE_RABBITMQ_MANAGEMENT_URL"):
            # The management API answers /api/nodes (the broker's alarms) to the monitoring tag only.
            if variable == "HOOKLINE_RABBITMQ_MANAGEMENT_URL" and "monitoring" not in tags[user]:
                if variable in env:
                    problems.append(f"{name}: {variable} as {user}, which has no monitoring tag")
            elif variable not in env:
                problems.append(f"{name}: no {variable}")
            else:
                problems += [
                    f"{name}: {variable}{problem}"
                    for problem in _credential_problems(
                        str(env[variable]), user, passwords.get(user), container, variable
                    )
                ]
    return list(dict.fromkeys(problems))


def _credential_problems(
    value: str, user: str, password: tuple[str, str] | None, container: Doc, variable: str
) -> list[str]:
    """Each address of a URL setting logs in as ``user`` with the Secret key ``password``."""
    problems = []
    for address in value.split(","):
        match = re.match(r"[a-z]+://([^:@/]*):([^@/]*)@", address.strip())
        if match is None:
            problems.append(" has an address without a user and password")
            continue
        if match.group(1) != user:
            problems.append(f" connects as {match.group(1)}, not {user}")
        reference = re.fullmatch(_REFERENCE, match.group(2))
        # Kubernetes expands a variable defined before this one only; a later one stays "$(...)".
        source = None if reference is None else secret_source(container, reference.group(1), before=variable)
        if source is None or source != password:
            problems.append(
                f"'s password is not {password_variable(user)} from the Secret the broker-setup Job sets "
                f"it from ({password}), but {source}"
            )
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
    assert {"Secret", "ConfigMap", "RabbitmqCluster", "PodDisruptionBudget", "ScaledObject", "Job"} <= kinds
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


def test_the_broker_setup_job_creates_exactly_the_role_users(docs: list[Doc]) -> None:
    assert setup_job_problems(docs) == []
    (job,) = setup_jobs(docs)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = setup_arguments(container)
    assert args is not None
    assert args.run.__name__ == "_broker_setup"
    given = {e["name"] for e in container["env"] if e["name"].startswith("HOOKLINE_BROKER_PASSWORD_")}
    assert given == {password_variable(user) for user in USERS.values()}


def test_each_service_connects_as_its_own_broker_user(docs: list[Doc]) -> None:
    assert credentials_problems(docs) == []
    assert set(ROLES) == set(SETTINGS)


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


def test_the_broker_password_placeholders_fail_the_setup_job_at_once(
    docs: list[Doc], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    placeholders = by_kind(docs, "Secret")["hookline-broker-users"]["stringData"]
    assert set(placeholders) == {password_variable(user) for user in USERS.values()}
    assert all(len(value) < MIN_PASSWORD_LENGTH for value in placeholders.values())
    # The Job's command, run with its environment as the placeholder Secret makes it: refused before
    # the broker is reached (nothing listens on port 9), with an exit code that fails the Job at once.
    (job,) = setup_jobs(docs)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    for name in [n for n in os.environ if n.upper().startswith("HOOKLINE_")]:
        monkeypatch.delenv(name)
    for entry in container["env"]:
        ref = entry.get("valueFrom", {}).get("secretKeyRef", {})
        if ref.get("name") == "hookline-broker-users":
            monkeypatch.setenv(entry["name"], placeholders[ref["key"]])
        elif entry["name"] in SETUP_VARIABLES:
            monkeypatch.setenv(entry["name"], entry["value"])
    argv = [*container["command"], *container.get("args", [])][1:]
    args = build_parser().parse_args([re.sub(_REFERENCE, "x", argument) for argument in argv])
    args.management_url = "http://admin:password@127.0.0.1:9"
    code = args.run(args)
    assert "is shorter than 16 characters" in capsys.readouterr().err
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"] == {"containerName": container["name"], "operator": "In", "values": [code]}


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


def _job_container(docs: list[Doc]) -> Doc:
    (job,) = setup_jobs(docs)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _dispatcher_as_the_ingest(docs: list[Doc]) -> None:
    _env(docs, "dispatcher", "BROKER_USER")["value"] = USERS[Role.INGEST]


def _monitor_with_the_dispatchers_password(docs: list[Doc]) -> None:
    ref = _env(docs, "health-monitor", "BROKER_PASSWORD")["valueFrom"]["secretKeyRef"]
    ref["key"] = password_variable(USERS[Role.DISPATCHER])


def _management_url_as_another_user(docs: list[Doc]) -> None:
    entry = _env(docs, "ingest", "HOOKLINE_RABBITMQ_MANAGEMENT_URL")
    entry["value"] = entry["value"].replace("$(BROKER_USER)", USERS[Role.DISPATCHER])


def _password_in_plain_text(docs: list[Doc]) -> None:
    entry = _env(docs, "dispatcher", "HOOKLINE_AMQP_URL")
    entry["value"] = entry["value"].replace("$(BROKER_PASSWORD)", "s3cr3t-in-the-manifest")


def _password_defined_after_the_url(docs: list[Doc]) -> None:
    (container,) = _workload(docs, "ingest")["spec"]["template"]["spec"]["containers"]
    entry = _env(docs, "ingest", "BROKER_PASSWORD")
    container["env"].remove(entry)
    container["env"].append(entry)  # $(BROKER_PASSWORD) is then not expanded in the URLs


def _service_as_the_administrator(docs: list[Doc]) -> None:
    _env(docs, "health-monitor", "BROKER_PASSWORD")["valueFrom"]["secretKeyRef"] = {
        "name": ADMIN_SECRET,
        "key": "password",
    }


def _job_missing_a_password(docs: list[Doc]) -> None:
    container = _job_container(docs)
    variable = password_variable(USERS[Role.MONITOR])
    container["env"] = [e for e in container["env"] if e["name"] != variable]


def _job_password_optional(docs: list[Doc]) -> None:
    entry = next(e for e in _job_container(docs)["env"] if e["name"] == password_variable(USERS[Role.INGEST]))
    entry["valueFrom"]["secretKeyRef"]["optional"] = True


def _job_upstream_without_password(docs: list[Doc]) -> None:
    _job_container(docs)["command"] += ["--upstream", "orders:acme"]


def _job_misspelled_option(docs: list[Doc]) -> None:
    command = _job_container(docs)["command"]
    command[command.index("--management-url")] = "--managment-url"


def _job_as_guest(docs: list[Doc]) -> None:
    command = _job_container(docs)["command"]
    command[-1] = "http://guest:guest@hookline-rabbitmq:15672"


def _job_on_another_vhost(docs: list[Doc]) -> None:
    _job_container(docs)["command"] += ["--vhost", "hookline"]


def _job_variable_misspelled(docs: list[Doc]) -> None:
    _job_container(docs)["env"].append({"name": "HOOKLINE_AMQP_URLS", "value": "amqp://hookline-rabbitmq/"})


def _job_writable_root(docs: list[Doc]) -> None:
    _job_container(docs)["securityContext"]["readOnlyRootFilesystem"] = False


def _job_kept_forever(docs: list[Doc]) -> None:
    (job,) = setup_jobs(docs)
    del job["spec"]["ttlSecondsAfterFinished"]


def _job_not_retried(docs: list[Doc]) -> None:
    (job,) = setup_jobs(docs)
    job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] = [1, 2]


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
    (_dispatcher_as_the_ingest, credentials_problems, "connects as hookline-ingest, not hookline-dispatcher"),
    (
        _monitor_with_the_dispatchers_password,
        credentials_problems,
        "password is not HOOKLINE_BROKER_PASSWORD_HOOKLINE_MONITOR",
    ),
    (_management_url_as_another_user, credentials_problems, "MANAGEMENT_URL connects as hookline-dispatcher"),
    (
        _password_in_plain_text,
        credentials_problems,
        "password is not HOOKLINE_BROKER_PASSWORD_HOOKLINE_DISPATCHER",
    ),
    (
        _password_defined_after_the_url,
        credentials_problems,
        "password is not HOOKLINE_BROKER_PASSWORD_HOOKLINE_INGEST",
    ),
    (_service_as_the_administrator, credentials_problems, f"hookline-health-monitor uses {ADMIN_SECRET}"),
    (_job_missing_a_password, setup_job_problems, "no HOOKLINE_BROKER_PASSWORD_HOOKLINE_MONITOR"),
    (_job_missing_a_password, env_problems, "HOOKLINE_BROKER_PASSWORD_HOOKLINE_MONITOR is not provided"),
    (_job_password_optional, setup_job_problems, "HOOKLINE_BROKER_PASSWORD_HOOKLINE_INGEST is not read from"),
    (_job_upstream_without_password, setup_job_problems, "no HOOKLINE_BROKER_PASSWORD_ORDERS"),
    (_job_misspelled_option, setup_job_problems, "not a `hookline broker-setup` the CLI accepts"),
    (_job_as_guest, setup_job_problems, "is not http://$(U):$(P)@hookline-rabbitmq:15672"),
    (_job_on_another_vhost, setup_job_problems, "grants on vhost 'hookline'"),
    (_job_variable_misspelled, env_problems, "HOOKLINE_AMQP_URLS is not a setting of hookline broker-setup"),
    (
        _job_writable_root,
        security_problems,
        "hookline-broker-setup/broker-setup: the root filesystem is writable",
    ),
    (_job_kept_forever, setup_job_problems, "no ttlSecondsAfterFinished"),
    (_job_not_retried, setup_job_problems, "exit 1 (the broker not reachable yet) fails the Job"),
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
