#!/usr/bin/env python3
"""The parts of scripts/helm-check that are easier in Python than in bash.

  helm-check.py schemas OUT_DIR K8S_SWAGGER_JSON CRD_YAML... -- RENDER...
      Writes a strict, standalone JSON schema (kubeconform's layout and file names:
      <kind>-<group>-<version>.json) for every apiVersion/kind in the renders: core
      kinds from the Kubernetes OpenAPI document (swagger.json of the k8s.io/kubernetes
      module), the rest from the CustomResourceDefinitions given. Strict as
      `kubectl --validate=strict`: every object schema with properties refuses other
      properties (unless it preserves unknown fields), kind and apiVersion must be the
      ones named. A kind with no source is an error, never skipped.

  helm-check.py checks ALERTS_YML NAME=RENDER...
      What a schema cannot say about the chart: the grace period covers the drain, the
      static membership, probes on the configured port, secrets only as files, the hook
      Jobs' annotations and what they mount, selectors that pick the members and only
      them, the PrometheusRule equal to deploy/prometheus/alerts.yml.
"""

import copy
import json
import os
import re
import sys
import tomllib

import yaml

# Mirror of "clickagg.secretFileVars" in deploy/helm/clickagg/templates/_helpers.tpl:
# the Secret key (file name) of each secret setting and the variable naming its file.
SECRET_FILE_VARS = {
    "kafka-sasl-password": "CLICKAGG__KAFKA__SASL_PASSWORD_FILE",
    "kafka-ssl-key-password": "CLICKAGG__KAFKA__SSL_KEY_PASSWORD_FILE",
    "kafka-oauth-client-secret": "CLICKAGG__KAFKA__OAUTH_CLIENT_SECRET_FILE",
    "redis-password": "CLICKAGG__REDIS__PASSWORD_FILE",
    "redis-url": "CLICKAGG__REDIS__URL_FILE",
    "clickhouse-password": "CLICKAGG__CLICKHOUSE__PASSWORD_FILE",
    "clickhouse-url": "CLICKAGG__CLICKHOUSE__URL_FILE",
    "dedup-fingerprint-key": "CLICKAGG__DEDUP__FINGERPRINT_KEY_FILE",
}
# Settings that are secrets (src/config/): never by value in the ConfigMap or env.
SECRET_SETTINGS = [
    ("kafka", "sasl_password"),
    ("kafka", "ssl_key_password"),
    ("kafka", "oauth_client_secret"),
    ("redis", "password"),
    ("clickhouse", "password"),
    ("dedup", "fingerprint_key"),
]

# --------------------------------------------------------------------------- schemas


def schema_file_name(api_version, kind):
    """kubeconform's {{ .ResourceKind }}{{ .KindSuffix }}.json."""
    parts = api_version.split("/")
    suffix = "-" + parts[0].split(".")[0].lower()
    if len(parts) > 1:
        suffix += "-" + parts[1].lower()
    return kind.lower() + suffix + ".json"


def strict(node):
    """Int-or-string as either, objects closed to unknown properties, no descriptions."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("format") == "int-or-string" or node.get("x-kubernetes-int-or-string"):
        return {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    out = {k: strict(v) for k, v in node.items() if k != "description"}
    if "properties" in out and "additionalProperties" not in out and not node.get(
        "x-kubernetes-preserve-unknown-fields"
    ):
        out["additionalProperties"] = False
    return out


def inline(node, defs, stack=()):
    """Resolves every $ref of an OpenAPI v2 definition into a standalone schema."""
    if isinstance(node, list):
        return [inline(n, defs, stack) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name in stack:  # a recursive type (none in the kinds a chart renders)
            return {}
        if name == "io.k8s.apimachinery.pkg.api.resource.Quantity":
            # The API server takes a number as well as a string ("cpu: 1").
            return {"oneOf": [{"type": "string"}, {"type": "number"}]}
        return inline(defs[name], defs, stack + (name,))
    return {k: inline(v, defs, stack) for k, v in node.items()}


def pin_kind(schema, api_version, kind):
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string", "enum": [api_version]}
    props["kind"] = {"type": "string", "enum": [kind]}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind"})
    return schema


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def schemas(argv):
    sep = argv.index("--")
    out_dir, swagger, crds, renders = argv[0], argv[1], argv[2:sep], argv[sep + 1 :]
    wanted = set()
    for r in renders:
        for d in load_docs(r):
            wanted.add((d["apiVersion"], d["kind"]))
    missing = [w for w in sorted(wanted) if not os.path.exists(os.path.join(out_dir, schema_file_name(*w)))]
    if not missing:
        return 0
    os.makedirs(out_dir, exist_ok=True)
    sources = {}
    with open(swagger) as f:
        defs = json.load(f)["definitions"]
    for name, d in defs.items():
        for gvk in d.get("x-kubernetes-group-version-kind", []):
            api_version = (gvk["group"] + "/" if gvk["group"] else "") + gvk["version"]
            sources[(api_version, gvk["kind"])] = lambda name=name: inline(defs[name], defs, (name,))
    for crd_file in crds:
        for crd in load_docs(crd_file):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                body = v["schema"]["openAPIV3Schema"]
                sources[(f"{group}/{v['name']}", kind)] = lambda body=body: copy.deepcopy(body)
    failed = False
    for api_version, kind in missing:
        source = sources.get((api_version, kind))
        if source is None:
            print(f"helm-check: no schema source for {kind} {api_version}", file=sys.stderr)
            failed = True
            continue
        schema = pin_kind(strict(source()), api_version, kind)
        with open(os.path.join(out_dir, schema_file_name(api_version, kind)), "w") as f:
            json.dump(schema, f)
    return 1 if failed else 0


# ---------------------------------------------------------------------------- checks

UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(text):
    """A humantime duration of the simple forms clickagg's examples use ("45s", "1m30s")."""
    parts = re.findall(r"(\d+)\s*(ms|s|m|h|d)", str(text))
    if not parts or "".join(n + u for n, u in parts) != re.sub(r"\s+", "", str(text)):
        raise ValueError(f"not a duration this check reads: {text!r}")
    return sum(int(n) * UNITS[u] for n, u in parts)


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


class Render:
    def __init__(self, name, path):
        self.name = name
        self.docs = load_docs(path)
        self.problems = []
        self.notes = []

    def find(self, kind, pred=lambda d: True):
        return [d for d in self.docs if d["kind"] == kind and pred(d)]

    def one(self, kind, pred=lambda d: True):
        found = self.find(kind, pred)
        if len(found) != 1:
            self.fail(f"expected one {kind}, found {len(found)}")
            return None
        return found[0]

    def fail(self, what):
        self.problems.append(what)

    def expect(self, ok, what):
        if not ok:
            self.fail(what)
        return ok


def hook_of(doc):
    a = (doc.get("metadata") or {}).get("annotations") or {}
    if "helm.sh/hook" not in a:
        return None
    return {
        "events": set(a["helm.sh/hook"].split(",")),
        "weight": int(a.get("helm.sh/hook-weight", "0")),
        "delete": set(filter(None, a.get("helm.sh/hook-delete-policy", "").split(","))),
    }


def env_map(container):
    return {e["name"]: e for e in container.get("env", [])}


def check_pod_config(r, pod_spec, container, what):
    """The configuration file, secrets and env of a member or a hook Job; returns the TOML."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
    args = container.get("args", [])
    env = env_map(container)
    config_path = args[args.index("--config") + 1] if "--config" in args else None
    if not r.expect(config_path and "config" in mounts and "config" in volumes, f"{what}: no --config file mounted"):
        return None
    r.expect(
        os.path.dirname(config_path) == mounts["config"]["mountPath"].rstrip("/"),
        f"{what}: --config {config_path} is not in the config mount {mounts['config']['mountPath']}",
    )
    cm_name = volumes["config"]["configMap"]["name"]
    cm = r.one("ConfigMap", lambda d: d["metadata"]["name"] == cm_name)
    if cm is None:
        return None
    text = cm["data"][os.path.basename(config_path)]
    try:
        toml = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        r.fail(f"{what}: ConfigMap {cm_name} is not TOML: {e}")
        return None
    for section, key in SECRET_SETTINGS:
        r.expect(key not in toml.get(section, {}), f"{what}: secret {section}.{key} in ConfigMap {cm_name}")

    # Secrets: only as files, each variable naming a file of the mounted Secret.
    secret_vol = volumes.get("secrets")
    items = {i["key"]: i["path"] for i in (secret_vol or {}).get("secret", {}).get("items", [])}
    for key, var in SECRET_FILE_VARS.items():
        plain = var[: -len("_FILE")]
        r.expect(plain not in env, f"{what}: {plain} carries a secret by value")
        if var not in env:
            r.expect(key not in items, f"{what}: Secret key {key} mounted but {var} not set")
            continue
        if not r.expect(secret_vol and "secrets" in mounts, f"{what}: {var} set but no Secret mounted"):
            continue
        expected = mounts["secrets"]["mountPath"].rstrip("/") + "/" + items.get(key, "?")
        r.expect(key in items, f"{what}: {var} names key {key}, which the Secret volume does not mount")
        r.expect(env[var].get("value") == expected, f"{what}: {var} = {env[var].get('value')!r}, not {expected!r}")
    for name in env:
        if name.endswith("_FILE") and name.startswith("CLICKAGG__"):
            r.expect(name in SECRET_FILE_VARS.values(), f"{what}: {name} is not a known secret file variable")
    if secret_vol:
        secret_name = secret_vol["secret"]["secretName"]
        made = r.find("Secret", lambda d: d["metadata"]["name"] == secret_name)
        for s in made:
            held = set((s.get("stringData") or {}) | (s.get("data") or {}))
            r.expect(set(items) <= held, f"{what}: Secret {secret_name} lacks {sorted(set(items) - held)}")

    # The image sets CLICKAGG__HTTP__ADDR; the file's http.addr counts only if env agrees.
    addr = toml.get("http", {}).get("addr")
    r.expect(
        env.get("CLICKAGG__HTTP__ADDR", {}).get("value") == addr,
        f"{what}: CLICKAGG__HTTP__ADDR {env.get('CLICKAGG__HTTP__ADDR')} != config http.addr {addr}",
    )
    return toml


def check_members(r):
    sts = r.one("StatefulSet")
    if sts is None:
        return
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    r.expect(c.get("args", [])[:1] == ["run"], f"member runs {c.get('args')}, not `clickagg run`")
    toml = check_pod_config(r, pod, c, "member")
    if toml is None:
        return

    # The grace period covers the drain, which stays within the session timeout.
    drain = seconds(toml.get("pipeline", {}).get("drain_timeout", "30s"))
    session = seconds(toml.get("kafka", {}).get("session_timeout", "45s"))
    grace = pod.get("terminationGracePeriodSeconds", 30)
    r.expect(grace > drain, f"terminationGracePeriodSeconds {grace} <= pipeline.drain_timeout {drain}s")
    r.expect(grace - drain >= 5, f"terminationGracePeriodSeconds {grace} leaves under 5 s after the drain ({drain}s)")
    r.expect(drain < session, f"pipeline.drain_timeout {drain}s >= kafka.session_timeout {session}s (clickagg refuses)")
    r.notes.append(f"grace {grace} s = drain {drain} s + {grace - drain} s")

    # Static membership from the pod name, never a shared value.
    env = env_map(c)
    gid = env.get("CLICKAGG__KAFKA__GROUP_INSTANCE_ID", {})
    r.expect(
        gid.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
        "CLICKAGG__KAFKA__GROUP_INSTANCE_ID is not the pod name (downward API metadata.name)",
    )
    r.expect("group_instance_id" not in toml.get("kafka", {}), "kafka.group_instance_id in the ConfigMap")

    # Probes on the port the member listens on.
    port = int(str(toml["http"]["addr"]).rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    r.expect(ports.get("http") == port, f"container port http {ports.get('http')} != http.addr port {port}")
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        get = (c.get(probe) or {}).get("httpGet", {})
        r.expect(get.get("path") == path, f"{probe} path {get.get('path')} != {path}")
        r.expect(get.get("port") in ("http", port), f"{probe} port {get.get('port')} != {port}")

    # Selectors: the StatefulSet, Service and PDB pick the members; no hook Job's pod.
    labels = sts["spec"]["template"]["metadata"]["labels"]
    r.expect(matches(spec["selector"]["matchLabels"], labels), "StatefulSet selector does not match its pods")
    svc = r.one("Service", lambda d: d["metadata"]["name"] == spec["serviceName"])
    selectors = {}
    if svc:
        selectors["Service"] = svc["spec"]["selector"]
        r.expect(svc["spec"].get("clusterIP") == "None", "the StatefulSet's Service is not headless")
        r.expect(any(p["port"] == port for p in svc["spec"]["ports"]), f"Service has no port {port}")
    pdb = r.one("PodDisruptionBudget")
    if pdb:
        selectors["PodDisruptionBudget"] = pdb["spec"]["selector"]["matchLabels"]
    for what, sel in selectors.items():
        r.expect(matches(sel, labels), f"{what} selector does not match the members")
        for job in r.find("Job"):
            job_labels = job["spec"]["template"]["metadata"].get("labels", {})
            r.expect(not matches(sel, job_labels), f"{what} selector also matches Job {job['metadata']['name']}")
    mon = r.find("ServiceMonitor")
    for m in mon:
        r.expect(svc and matches(m["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]),
                 "ServiceMonitor selects no Service of the chart")
        ep = m["spec"]["endpoints"][0]
        r.expect(ep.get("port") == "http" and ep.get("path", "/metrics") == "/metrics", "ServiceMonitor endpoint")
        r.expect(
            any(x.get("targetLabel") == "job" and x.get("replacement") == "clickagg" for x in ep.get("relabelings", [])),
            'ServiceMonitor does not name the job "clickagg" (ClickaggMemberDown expects it)',
        )
    return toml


def check_hooks(r, member_toml):
    jobs = {j["metadata"]["name"]: j for j in r.find("Job")}
    migrate = [j for j in jobs.values() if j["spec"]["template"]["spec"]["containers"][0]["args"][:1] == ["migrate"]]
    if not r.expect(len(migrate) == 1, f"expected one migrate Job, found {len(migrate)}"):
        return
    for job in jobs.values():
        name = job["metadata"]["name"]
        hook = hook_of(job)
        pod = job["spec"]["template"]["spec"]
        c = pod["containers"][0]
        if not r.expect(hook, f"Job {name} is not a Helm hook"):
            continue
        args = c["args"]
        if args[:1] == ["migrate"]:
            r.expect({"pre-install", "pre-upgrade"} <= hook["events"], f"Job {name}: hook {hook['events']}")
        elif args[:2] == ["settings", "change"]:
            r.expect(hook["events"] == {"pre-upgrade"}, f"Job {name}: hook {hook['events']}, not pre-upgrade")
            r.expect(hook["weight"] > hook_of(migrate[0])["weight"], f"Job {name} does not run after migrate")
        else:
            r.fail(f"Job {name} runs {args}")
        r.expect("before-hook-creation" in hook["delete"], f"Job {name}: a rerun would collide with the last Job")
        r.expect(pod.get("restartPolicy") in ("Never", "OnFailure"), f"Job {name}: restartPolicy")
        # What a hook mounts exists when it runs: a hook made before it, or a thing the
        # chart does not make (secret.existingSecret, tls.existingSecret).
        for v in pod.get("volumes", []):
            for kind, ref in (("ConfigMap", v.get("configMap", {}).get("name")), ("Secret", v.get("secret", {}).get("secretName"))):
                if not ref:
                    continue
                made = r.find(kind, lambda d, ref=ref: d["metadata"]["name"] == ref)
                for d in made:
                    h = hook_of(d)
                    r.expect(
                        h and hook["events"] <= h["events"] and h["weight"] < hook["weight"],
                        f"Job {name} mounts {kind} {ref}, which is not a hook made before it (it does not exist yet on install)",
                    )
        toml = check_pod_config(r, pod, c, f"Job {name}")
        r.expect(toml == member_toml, f"Job {name} reads another configuration than the members")
        r.notes.append(f"{name}: {','.join(sorted(hook['events']))} weight {hook['weight']}")


def check_rules(r, alerts):
    for rule in r.find("PrometheusRule"):
        r.expect(rule["spec"] == alerts, "PrometheusRule spec differs from deploy/prometheus/alerts.yml")
        r.notes.append(f"PrometheusRule = alerts.yml ({sum(len(g['rules']) for g in alerts['groups'])} rules)")


def checks(argv):
    with open(argv[0]) as f:
        alerts = yaml.safe_load(f)
    failed = 0
    for arg in argv[1:]:
        name, path = arg.split("=", 1)
        r = Render(name, path)
        toml = check_members(r)
        if toml is not None:
            check_hooks(r, toml)
        check_rules(r, alerts)
        kinds = sorted({d["kind"] for d in r.docs})
        if r.problems:
            failed += 1
            print(f"FAIL {name}:")
            for p in r.problems:
                print(f"  - {p}")
        else:
            print(f"ok   {name}: {len(r.docs)} objects ({', '.join(kinds)}); " + "; ".join(r.notes))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("schemas", "checks"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit({"schemas": schemas, "checks": checks}[sys.argv[1]](sys.argv[2:]))
