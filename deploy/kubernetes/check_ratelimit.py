#!/usr/bin/env python3
"""Checks what kubernetes-validate cannot in ratelimit.yaml (envoyproxy/ratelimit and its Redis)
and ties it to the sidecar configs that call it. Every mistake caught here deploys cleanly and
then fails quietly: envoyproxy/ratelimit ignores an environment variable it does not know, and
answers OK for a descriptor its config does not limit.

  - every env name of the ratelimit container is one its settings.go reads (--settings), and
    the values the README names are set: USE_STATSD=false, REDIS_SOCKET_TYPE=tcp,
    RUNTIME_WATCH_ROOT=false, RUNTIME_IGNOREDOTFILES=true (a ConfigMap mount's ..data entries
    are read as a second copy otherwise), a loopback DEBUG_HOST,
    HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED=true, LIMIT_RESPONSE_HEADERS_ENABLED=true;
  - the image is pinned (a tag, not latest or master) and run as /bin/ratelimit (it has no
    ENTRYPOINT);
  - the ConfigMap is mounted as a directory at RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/
    RUNTIME_APPDIRECTORY; each of its *.yaml files parses, with one domain per file;
  - GRPC_PORT and PORT are the container's grpc and http ports; the probes GET /healthcheck on
    PORT; the ratelimit Service leads to GRPC_PORT; REDIS_URL is host:port of a Service in the
    namespace whose port leads to a Redis container's port;
  - the sidecar configs that use it (the README's examples in "Fleet-wide quota", and a
    commented `# global_rate_limit:` block in a sidecar manifest's config, uncommented): the
    service URL is the Service's name, namespace and port; the domain is in the ConfigMap;
    every descriptor a request sends reaches a `rate_limit` there (else the service answers
    OK for it and every call is wasted); `tokens: true` exactly when a descriptor holds
    { key: unit, value: tokens };
  - the README's ratelimit config (a yaml block with a top-level `domain`) is the ConfigMap's.

--emit-ratelimit DIR writes the ConfigMap's files (for envoyproxy/ratelimit's config_check_cmd);
--emit-sidecar DIR writes each sidecar config found (for `egress-sidecar check`).

Usage: check_ratelimit.py --settings settings.go [--emit-ratelimit DIR] [--emit-sidecar DIR]
           --readme README.md RATELIMIT_YAML [SIDECAR_YAML...]
exit 1 with one line per problem.
"""

import argparse
import os
import re
import sys

import yaml

README_SECTION = "## Fleet-wide quota (rate-limit service)"
# Values a request's descriptor entries take, for walking the service's config.
SAMPLE_APP = "some-app"
SAMPLE_HEADER_VALUE = "some-value"
REQUIRED_ENV = {
    "USE_STATSD": "false",
    "REDIS_SOCKET_TYPE": "tcp",
    "RUNTIME_WATCH_ROOT": "false",
    "RUNTIME_IGNOREDOTFILES": "true",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED": "true",
    "LIMIT_RESPONSE_HEADERS_ENABLED": "true",
}
# envoyproxy/ratelimit's defaults (settings.go) for what the wiring reads.
ENV_DEFAULTS = {"PORT": "8080", "GRPC_PORT": "8081", "DEBUG_HOST": "0.0.0.0"}


def settings_names(path):
    """The environment names settings.go reads: its `envconfig:"NAME"` tags."""
    names = set(re.findall(r'envconfig:"([A-Z0-9_]+)"', open(path).read()))
    if len(names) < 20:
        sys.exit(f"check_ratelimit.py: {path}: found {len(names)} envconfig names; not settings.go?")
    return names


def pod_matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_port(container, port):
    """A Service targetPort or probe port (a name or a number) as the container's number."""
    for p in container.get("ports") or []:
        if port in (p.get("name"), p.get("containerPort")):
            return p["containerPort"]
    return None


class Manifest:
    def __init__(self, docs):
        self.docs = [d for d in docs if d]

    def of_kind(self, kind):
        return [d for d in self.docs if d.get("kind") == kind]

    def named(self, kind, name, namespace):
        for d in self.of_kind(kind):
            meta = d.get("metadata") or {}
            if meta.get("name") == name and meta.get("namespace") == namespace:
                return d
        return None

    def service_target(self, service, port):
        """(deployment, container, container port) the Service's `port` leads to, or None."""
        ns = service["metadata"].get("namespace")
        selector = service["spec"].get("selector") or {}
        for sp in service["spec"].get("ports") or []:
            if sp.get("port") != port:
                continue
            target = sp.get("targetPort", port)
            for dep in self.of_kind("Deployment"):
                if dep["metadata"].get("namespace") != ns:
                    continue
                pod = dep["spec"]["template"]
                if not pod_matches(selector, (pod.get("metadata") or {}).get("labels") or {}):
                    continue
                for c in pod["spec"].get("containers") or []:
                    number = container_port(c, target)
                    if number is not None:
                        return dep, c, number
        return None


def check_service_side(m, settings, problems):
    """The ratelimit Deployment's wiring: (namespace, (service, port), configs, their texts)."""
    bad = problems.append
    deps = [d for d in m.of_kind("Deployment") if any(
        c.get("command") == ["/bin/ratelimit"]
        for c in d["spec"]["template"]["spec"].get("containers") or [])]
    if len(deps) != 1:
        bad(f"expected one Deployment running /bin/ratelimit, found {len(deps)}")
        return None
    dep = deps[0]
    ns = dep["metadata"].get("namespace")
    pod = dep["spec"]["template"]
    container = next(c for c in pod["spec"]["containers"] if c.get("command") == ["/bin/ratelimit"])
    where = f"Deployment {dep['metadata']['name']}"

    image = container.get("image", "")
    tag = image.rsplit("/", 1)[-1].partition(":")[2].partition("@")[0]
    if not tag or tag in ("latest", "master", "main"):
        bad(f"{where}: image {image!r} is not pinned to a tag")

    env = {}
    for e in container.get("env") or []:
        if "value" not in e:
            bad(f"{where}: env {e.get('name')} has no literal value")
            continue
        env[e["name"]] = str(e["value"])
    for name in sorted(set(env) - settings):
        bad(f"{where}: env {name} is no envoyproxy/ratelimit setting (settings.go ignores it)")
    for name, want in REQUIRED_ENV.items():
        if env.get(name) != want:
            bad(f"{where}: env {name} must be {want!r} (is {env.get(name)!r})")
    get = lambda name: env.get(name, ENV_DEFAULTS.get(name))
    if get("DEBUG_HOST") not in ("127.0.0.1", "::1", "localhost"):
        bad(f"{where}: DEBUG_HOST {get('DEBUG_HOST')!r} serves pprof beyond the pod; use 127.0.0.1")

    # The config files: the ConfigMap mounted whole where the runtime loader looks.
    config_dir = "/".join(p.strip("/") for p in (env.get("RUNTIME_ROOT", ""), env.get(
        "RUNTIME_SUBDIRECTORY", ""), env.get("RUNTIME_APPDIRECTORY", "config")) if p.strip("/"))
    config_dir = "/" + config_dir
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    configs, texts = {}, {}
    mounts = [vm for vm in container.get("volumeMounts") or [] if vm.get("mountPath", "").rstrip("/") == config_dir]
    if not mounts:
        bad(f"{where}: nothing mounted at {config_dir} (RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY)")
    for vm in mounts:
        if vm.get("subPath"):
            bad(f"{where}: {config_dir} is a subPath mount: ConfigMap edits would never reach it")
        cm_name = ((volumes.get(vm["name"]) or {}).get("configMap") or {}).get("name")
        cm = m.named("ConfigMap", cm_name, ns) if cm_name else None
        if cm is None:
            bad(f"{where}: {config_dir} is no ConfigMap of namespace {ns}")
            continue
        for key, text in (cm.get("data") or {}).items():
            if not key.endswith(".yaml"):
                bad(f"ConfigMap {cm_name}: {key}: the service loads only *.yaml files")
                continue
            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError as e:
                bad(f"ConfigMap {cm_name}: {key}: {e}")
                continue
            if not isinstance(doc, dict) or not doc.get("domain"):
                bad(f"ConfigMap {cm_name}: {key}: no domain")
                continue
            if doc["domain"] in {d["domain"] for d in configs.values()}:
                bad(f"ConfigMap {cm_name}: {key}: domain {doc['domain']} twice")
            configs[key] = doc
            texts[key] = text
    if not configs:
        bad(f"{where}: no ratelimit config found")

    # Ports and probes.
    grpc_port = int(get("GRPC_PORT"))
    http_port = int(get("PORT"))
    if container_port(container, "grpc") != grpc_port:
        bad(f"{where}: container port grpc is not GRPC_PORT {grpc_port}")
    if container_port(container, "http") != http_port:
        bad(f"{where}: container port http is not PORT {http_port}")
    for probe in ("readinessProbe", "livenessProbe"):
        get_ = (container.get(probe) or {}).get("httpGet")
        if not get_ or get_.get("path") != "/healthcheck" or container_port(container, get_.get("port")) != http_port:
            bad(f"{where}: {probe} must GET /healthcheck on PORT {http_port}")

    service = None
    for svc in m.of_kind("Service"):
        if svc["metadata"].get("namespace") != ns:
            continue
        for sp in svc["spec"].get("ports") or []:
            hit = m.service_target(svc, sp["port"])
            if hit and hit[0] is dep and hit[2] == grpc_port:
                service = (svc["metadata"]["name"], sp["port"])
    if service is None:
        bad(f"{where}: no Service in {ns} leads to GRPC_PORT {grpc_port}")

    # Redis: host:port of a Service in the namespace that leads to a redis container.
    host, _, port = env.get("REDIS_URL", "").rpartition(":")
    svc_name = host.split(".")[0]
    redis_svc = m.named("Service", svc_name, ns) if port.isdigit() else None
    hit = m.service_target(redis_svc, int(port)) if redis_svc else None
    if host not in (svc_name, f"{svc_name}.{ns}", f"{svc_name}.{ns}.svc", f"{svc_name}.{ns}.svc.cluster.local"):
        hit = None
    if not hit or "redis" not in hit[1].get("image", ""):
        bad(f"{where}: REDIS_URL {env.get('REDIS_URL')!r} is no Service port of a redis container in {ns}")
    return ns, service, configs, texts


def walk(tree, entries):
    """envoyproxy/ratelimit's GetLimit: each entry matches key_value, a `value: prefix*`
    wildcard, then the bare key; the limit is the last entry's node's."""
    node = None
    for key, value in entries:
        nxt = None
        for d in tree or []:
            v = d.get("value")
            if d.get("key") == key and v is not None and (v == value or (v.endswith("*") and value.startswith(v[:-1]))):
                nxt = d
                break
        if nxt is None:
            nxt = next((d for d in tree or [] if d.get("key") == key and d.get("value") is None), None)
        if nxt is None:
            return None
        node, tree = nxt, nxt.get("descriptors")
    return node.get("rate_limit") if node else None


def entries_of(descriptor, upstream):
    out = []
    for e in descriptor:
        if "value" in e:
            out.append((e["key"], str(e["value"])))
        elif e.get("key") == "upstream":
            out.append(("upstream", upstream))
        elif e.get("key") == "app":
            out.append(("app", SAMPLE_APP))
        elif e.get("key") == "header":
            out.append((e.get("name", ""), SAMPLE_HEADER_VALUE))
        else:
            return None
    return out


def check_sidecar(where, config, ns, service, configs, problems):
    bad = problems.append
    domains = {c["domain"]: c for c in configs.values()}
    uses = 0
    default = (config.get("defaults") or {}).get("global_rate_limit")
    for i, up in enumerate(config.get("upstreams") or []):
        grl = up.get("global_rate_limit") or default
        if not grl:
            continue
        uses += 1
        at = f"{where}: upstreams[{i}] ({up.get('name')})"
        if service:
            want = {f"http://{service[0]}.{ns}{suffix}:{service[1]}"
                    for suffix in ("", ".svc", ".svc.cluster.local")}
            if grl.get("service") not in want:
                bad(f"{at}: service {grl.get('service')!r} is not the ratelimit Service (http://{service[0]}.{ns}:{service[1]})")
        tree = domains.get(grl.get("domain"))
        if tree is None:
            bad(f"{at}: domain {grl.get('domain')!r} is in no ratelimit config")
            continue
        token_descriptors = 0
        for j, d in enumerate(grl.get("descriptors") or []):
            entries = entries_of(d, up.get("name"))
            if entries is None:
                bad(f"{at}: descriptors[{j}]: an entry the sidecar has no value for: {d}")
                continue
            token_descriptors += ("unit", "tokens") in entries
            if walk(tree.get("descriptors"), entries) is None:
                bad(f"{at}: descriptors[{j}] {entries} reaches no rate_limit in domain {tree['domain']}: the service answers OK for it")
        if bool(grl.get("tokens")) != (token_descriptors > 0):
            bad(f"{at}: tokens is {bool(grl.get('tokens'))} with {token_descriptors} token descriptors")
    if not uses:
        bad(f"{where}: no upstream has a global_rate_limit section")


def readme_blocks(path):
    text = open(path).read()
    start = text.find("\n" + README_SECTION + "\n")
    if start < 0:
        sys.exit(f"check_ratelimit.py: {path}: no section {README_SECTION!r}")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else len(text)]
    return [(yaml.safe_load(b), b + "\n") for b in re.findall(r"\n```yaml\n(.*?)\n```", section, re.S)]


def commented_block(text):
    """A config with its commented `# global_rate_limit:` block uncommented, or None."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)# global_rate_limit:\s*$", line)
        if not m:
            continue
        prefix = m.group(1) + "# "
        lines[i] = m.group(1) + line[len(prefix):]
        for k in range(i + 1, len(lines)):
            if not lines[k].startswith(prefix + " "):
                break
            lines[k] = m.group(1) + lines[k][len(prefix):]
        return "\n".join(lines)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", required=True)
    ap.add_argument("--readme", required=True)
    ap.add_argument("--emit-ratelimit")
    ap.add_argument("--emit-sidecar")
    ap.add_argument("ratelimit")
    ap.add_argument("sidecars", nargs="*")
    args = ap.parse_args()

    problems = []
    m = Manifest(yaml.safe_load_all(open(args.ratelimit)))
    side = check_service_side(m, settings_names(args.settings), problems)
    ns, service, configs, texts = side if side else (None, None, {}, {})

    sidecar_configs = []
    readme_ratelimit = 0
    for n, (block, raw) in enumerate(readme_blocks(args.readme)):
        if isinstance(block, dict) and "domain" in block:
            readme_ratelimit += 1
            if block not in configs.values():
                problems.append(f"{args.readme}: the ratelimit config in {README_SECTION[3:]} is not ratelimit.yaml's ConfigMap")
        elif isinstance(block, dict) and ("upstreams" in block or "defaults" in block):
            sidecar_configs.append((f"README-{n}", block, raw))
    if not readme_ratelimit:
        problems.append(f"{args.readme}: no ratelimit config (a yaml block with `domain`) in {README_SECTION[3:]}")
    for path in args.sidecars:
        for doc in yaml.safe_load_all(open(path)):
            text = ((doc or {}).get("data") or {}).get("config.yaml") if (doc or {}).get("kind") == "ConfigMap" else None
            uncommented = commented_block(text) if text else None
            if uncommented:
                name = f"{os.path.basename(path)}-{doc['metadata']['name']}-global_rate_limit"
                sidecar_configs.append((name, yaml.safe_load(uncommented), uncommented))
    if not sidecar_configs:
        problems.append("no sidecar config uses the service")
    for name, config, _ in sidecar_configs:
        check_sidecar(name, config, ns, service, configs, problems)

    for dest, files in ((args.emit_ratelimit, texts),
                        (args.emit_sidecar, {f"{n}.yaml": t for n, _, t in sidecar_configs})):
        if dest:
            os.makedirs(dest, exist_ok=True)
            for name, text in files.items():
                open(os.path.join(dest, name), "w").write(text)

    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"ratelimit: {len(configs)} config(s), {len(sidecar_configs)} sidecar config(s) checked")


if __name__ == "__main__":
    main()
