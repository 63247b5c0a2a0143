"""Validate what `helm template` rendered from the kvconductor chart.

    python deploy/validate.py RENDERED.yaml [RENDERED.yaml ...]
    python deploy/validate.py --topics-job-against HOST:PORT RENDERED.yaml

Per file, every object:

- Kubernetes' own kinds against the Kubernetes OpenAPI schemas of the oldest
  and the newest release the chart supports (the `kubernetes-validate`
  package, strict: unknown fields are errors);
- the custom resources (Strimzi's KafkaTopic, the Prometheus operator's
  ServiceMonitor), whose schemas ship with their operators and not here,
  structurally: the fields the chart writes, their types, and the values
  that must agree with kvconductor (below);

and across objects, what no schema sees:

- each TOML file in a ConfigMap loads with kvconductor's own loader (the
  daemon's or the bridge's), with the environment of the container that
  reads it and placeholder files at the mounted secret paths;
- the KafkaTopics (and the hook Job's script, `--list`) name exactly the
  topics, partitions and compaction the daemon's `topic_specs` asks for;
- selectors of Services, PodDisruptionBudgets, NetworkPolicies and the
  ServiceMonitor match pods or Services of the release; probes name a
  container port; volume mounts name a volume.

Exit status 1 with one line per problem.

With --topics-job-against, it runs the rendered hook Job's script against a
real broker instead (deploy/check does when CI's broker is there).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

# The chart's kubeVersion floor, and the newest release the package knows.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
        "namespace": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    # Strimzi's KafkaTopic (kafka.strimzi.io v1 and v1beta2 share these fields).
    "KafkaTopic": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"enum": ["kafka.strimzi.io/v1", "kafka.strimzi.io/v1beta2"]},
            "metadata": {
                **METADATA,
                "properties": {
                    **METADATA["properties"],
                    "labels": {
                        "type": "object",
                        "required": ["strimzi.io/cluster"],
                        "additionalProperties": {"type": "string"},
                    },
                },
            },
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["topicName", "partitions"],
                "properties": {
                    "topicName": {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,249}$"},
                    "partitions": {"type": "integer", "minimum": 1},
                    "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
                    "config": {
                        "type": "object",
                        "additionalProperties": {
                            "type": ["string", "integer", "number", "boolean"]
                        },
                    },
                },
            },
        },
    },
    # The Prometheus operator's ServiceMonitor (monitoring.coreos.com/v1).
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "metadata": METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matchLabels": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                            }
                        },
                    },
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matchNames": {"type": "array", "items": {"type": "string"}}
                        },
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["port", "path"],
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string", "pattern": "^/"},
                                "interval": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                                "scrapeTimeout": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                                "relabelings": {"type": "array", "items": {"type": "object"}},
                            },
                        },
                    },
                },
            },
        },
    },
}

WORKLOADS = ("Deployment", "StatefulSet", "Job")


def documents(path: Path) -> Iterator[dict[str, Any]]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            yield doc


def label(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_spec(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in WORKLOADS:
        return obj["spec"]["template"]["spec"]  # type: ignore[no-any-return]
    return None


def pod_labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("labels", {})  # type: ignore[no-any-return]


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def schema_problems(obj: dict[str, Any]) -> list[str]:
    kind = obj["kind"]
    if kind in CRD_SCHEMAS:
        errors = jsonschema.Draft202012Validator(CRD_SCHEMAS[kind]).iter_errors(obj)
        return [f"{label(obj)}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    problems = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            problems.append(f"{label(obj)}: Kubernetes {version}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(
                f"{label(obj)}: Kubernetes {version} has no schema for {obj['apiVersion']}"
            )
    return problems


def pod_problems(obj: dict[str, Any]) -> list[str]:
    spec = pod_spec(obj)
    if spec is None:
        return []
    problems = []
    volumes = {v["name"] for v in spec.get("volumes", [])}
    for c in spec["containers"]:
        ports = {p.get("name") for p in c.get("ports", [])}
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            for how in ("httpGet", "tcpSocket"):
                port = c.get(probe, {}).get(how, {}).get("port")
                if isinstance(port, str) and port not in ports:
                    problems.append(
                        f"{label(obj)}: {probe} names port {port!r}, not a container port"
                    )
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                problems.append(f"{label(obj)}: mounts volume {m['name']!r}, which is not declared")
    return problems


def selector_problems(objs: list[dict[str, Any]]) -> list[str]:
    pods = [pod_labels(o) for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    services = [o["metadata"].get("labels", {}) for o in objs if o["kind"] == "Service"]
    problems = []
    for o in objs:
        kind, spec = o["kind"], o.get("spec", {})
        if kind == "Service":
            selector = spec["selector"]
        elif kind in ("PodDisruptionBudget",):
            selector = spec["selector"]["matchLabels"]
        elif kind == "NetworkPolicy":
            selector = spec["podSelector"]["matchLabels"]
        elif kind == "ServiceMonitor":
            if not any(matches(spec["selector"]["matchLabels"], s) for s in services):
                problems.append(f"{label(o)}: its selector matches no Service")
            continue
        elif kind in ("Deployment", "StatefulSet"):
            if not matches(spec["selector"]["matchLabels"], pod_labels(o)):
                problems.append(f"{label(o)}: its selector does not match its own pods")
            continue
        else:
            continue
        if not any(matches(selector, p) for p in pods):
            problems.append(f"{label(o)}: its selector matches no pod of the release")
    return problems


DOCKERFILE = Path(__file__).resolve().parent.parent / "Dockerfile"


def image_env() -> dict[str, str]:
    """The KVCONDUCTOR_* variables the image sets (the Dockerfile's ENV
    instructions): a container's own env overrides them, the file does not."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(KVCONDUCTOR_[A-Z0-9_]+)=(\S*)", line))
    return env


def container_env(container: Mapping[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the pod would see it: the image's, then
    its own (the pod's name where the downward API gives it)."""
    env: dict[str, str] = image_env()
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(
                r"\$\(([A-Za-z0-9_]+)\)", lambda m: env.get(m[1], ""), e["value"]
            )
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod_name
    return env


def config_problems(objs: list[dict[str, Any]], scratch: Path) -> tuple[list[str], Any]:
    """Load each ConfigMap's TOML file with kvconductor's loader, as each
    container that reads it would; also return the daemon's configuration."""
    from kvconductor.bridge.config import load_bridge_config
    from kvconductor.config import ConfigError, load_config

    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
    problems = []
    loaded = 0
    daemon = None
    for o in objs:
        spec = pod_spec(o)
        if spec is None:
            continue
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            root = scratch / f"{o['metadata']['name']}-{c['name']}"
            files: dict[str, str] = {}
            # Every mounted file, at its path under `root`: ConfigMap keys with
            # their content, secret items as placeholders.
            for m in c.get("volumeMounts", []):
                v = volumes.get(m["name"], {})
                base = root / m["mountPath"].lstrip("/")
                base.mkdir(parents=True, exist_ok=True)
                if "configMap" in v:
                    for key, text in maps.get(v["configMap"]["name"], {}).items():
                        files[f"{m['mountPath']}/{key}"] = text
                elif "secret" in v:
                    for item in v["secret"].get("items", []):
                        (base / item["path"]).write_text("placeholder-secret\n")
            command = [*c.get("command", []), *c.get("args", [])]
            if "--config" not in command:
                continue
            config = command[command.index("--config") + 1]
            if config not in files:
                problems.append(f"{label(o)}: --config {config} is not in a mounted ConfigMap")
                continue
            text = files[config]
            for mount in c.get("volumeMounts", []):
                text = text.replace(f'"{mount["mountPath"]}/', f'"{root}{mount["mountPath"]}/')
            path = root / config.lstrip("/")
            path.write_text(text)
            env = container_env(c, f"{o['metadata']['name']}-0")
            loader = load_bridge_config if "bridge" in command else load_config
            try:
                cfg = loader(path, env)
                loaded += 1
                if command[:2] == ["kvconductor", "run"]:
                    daemon = cfg
            except ConfigError as exc:
                problems.append(f"{label(o)} container {c['name']}: {config}: {exc}")
            if "ensure-topics.py" in " ".join(command):
                problems += topic_problems(path, env, files, root, command)
    if not loaded and not problems:
        problems.append("no container loads a configuration file")
    return problems, daemon


def topic_problems(
    config: Path,
    env: Mapping[str, str],
    files: Mapping[str, str],
    root: Path,
    command: list[str],
) -> list[str]:
    """The hook Job's script runs on its configuration (`--list`: the topics
    it would create, nothing connected)."""
    script = next(a for a in command if a.endswith("ensure-topics.py"))
    (root / script.lstrip("/")).write_text(files[script])
    run = subprocess.run(
        [sys.executable, str(root / script.lstrip("/")), "--config", str(config), "--list"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if run.returncode:
        return [f"the topics Job's script --list failed: {run.stderr.strip()}"]
    if not run.stdout.strip():
        return ["the topics Job's script listed no topics"]
    return []


def kafka_topic_problems(objs: list[dict[str, Any]], cfg: Any) -> list[str]:
    topics = [o for o in objs if o["kind"] == "KafkaTopic"]
    if not topics:
        return []
    if cfg is None:
        return ["KafkaTopics rendered but no daemon configuration to compare them with"]
    from kvconductor.kafka.topics import DEFAULT_REPLICATION, replication_for, topic_specs

    want = {s.name: s for s in topic_specs(cfg)}
    have = {t["spec"]["topicName"]: t["spec"] for t in topics}
    problems = []
    if set(want) != set(have):
        problems.append(f"KafkaTopics name {sorted(have)}, the daemon uses {sorted(want)}")
    for name, spec in want.items():
        t = have.get(name)
        if t is None:
            continue
        if t["partitions"] != spec.partitions:
            problems.append(
                f"KafkaTopic {name}: {t['partitions']} partitions, "
                f"the daemon creates {spec.partitions}"
            )
        configs = {k: str(v) for k, v in (t.get("config") or {}).items()}
        for key, value in spec.configs.items():
            if configs.get(key) != value:
                problems.append(
                    f"KafkaTopic {name}: {key}={configs.get(key)!r}, the daemon sets {value!r}"
                )
        if spec.replication_factor is not None:
            factor, min_isr = replication_for(
                spec,
                0,
                DEFAULT_REPLICATION._replace(min_insync_replicas=cfg.kafka.min_insync_replicas),
            )
            if t.get("replicas") != factor or configs.get("min.insync.replicas") != str(min_isr):
                problems.append(
                    f"KafkaTopic {name}: replicas {t.get('replicas')}, min.insync.replicas "
                    f"{configs.get('min.insync.replicas')}; "
                    f"the daemon creates {factor} and {min_isr}"
                )
    return problems


def run_topics_job(path: Path, bootstrap: str) -> int:
    """Run the hook Job's script, as rendered in `path`, against a real broker
    at `bootstrap`, twice (the second run finds every topic and checks it),
    with topic names of its own so that nothing else on that broker is touched."""
    objs = list(documents(path))
    job = next(o for o in objs if o["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    maps = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    config_map = next(
        v["configMap"]["name"]
        for v in job["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "config"
    )
    prefix = f"deploy-check-{os.getpid()}"
    env = {
        **os.environ,
        **container_env(container, "topics"),
        "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "KVCONDUCTOR_LOG_FORMAT": "json",
        **{
            f"KVCONDUCTOR_KAFKA_{key}_TOPIC": f"{prefix}-{key.lower()}"
            for key in ("ENGINE", "POOL", "SNAPSHOT", "DEAD_LETTER")
        },
        "KVCONDUCTOR_HTTP_REGISTRATIONS_TOPIC": f"{prefix}-registrations",
    }
    with tempfile.TemporaryDirectory() as scratch:
        for key, text in maps[config_map].items():
            (Path(scratch) / key).write_text(text)
        command = [sys.executable, "ensure-topics.py", "--config", "kvconductor.toml"]
        for attempt in ("create", "check"):
            run = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
            created = "topics created" in run.stdout
            # The second run finds them all, and checks the snapshot topic's compaction.
            if run.returncode or created != (attempt == "create"):
                print(
                    f"validate: the topics Job's script ({attempt}) on {bootstrap} failed:\n"
                    f"{run.stdout}{run.stderr}",
                    file=sys.stderr,
                )
                return 1
    print(f"validate: the topics Job's script created and checked {prefix}-* on {bootstrap}: ok")
    return 0


def main(paths: list[str]) -> int:
    problems: list[str] = []
    for name in paths:
        path = Path(name)
        objs = list(documents(path))
        found = [f"{path.name}: {p}" for o in objs for p in schema_problems(o) + pod_problems(o)]
        found += [f"{path.name}: {p}" for p in selector_problems(objs)]
        with tempfile.TemporaryDirectory() as scratch:
            config, daemon = config_problems(objs, Path(scratch))
            found += [f"{path.name}: {p}" for p in config]
        found += [f"{path.name}: {p}" for p in kafka_topic_problems(objs, daemon)]
        kinds = sorted({o["kind"] for o in objs})
        print(
            f"validate: {path.name}: {len(objs)} objects ({', '.join(kinds)}): "
            f"{'ok' if not found else f'{len(found)} problem(s)'}"
        )
        problems += found
    for p in problems:
        print(f"validate: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--topics-job-against"]:
        sys.exit(run_topics_job(Path(sys.argv[3]), sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
