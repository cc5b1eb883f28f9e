#!/usr/bin/env python3
"""Checks a Cloud Run multi-container service.yaml offline: the structure and required fields
Cloud Run's API would insist on, and the wiring the egress sidecar needs.

No Kubernetes schema covers Knative/Cloud Run services, so the rules are written out here:
  - serving.knative.dev/v1 Service with a name, and only the container fields Cloud Run
    accepts (a misspelt key is an error, as with kubernetes-validate --strict);
  - 1 to 10 containers with unique DNS-label names and an image; exactly one ingress container
    (the only one with `ports`, exactly one port);
  - run.googleapis.com/container-dependencies is a JSON map of existing container names with
    no self-dependency or cycle, and every container depended on has a startupProbe (Cloud Run
    waits only for those);
  - each container has memory and CPU limits;
  - the egress sidecar (image .../egress-sidecar:*): probe by httpGet/tcpSocket (Cloud Run has
    no exec probes) on a port it binds on all interfaces, startup gates the app, memory limit
    at least 64Mi (measured peak 7.6 MiB; see README);
  - the app: HTTP_PROXY and http_proxy equal and pointing at the sidecar's EGRESS_LISTEN port
    on 127.0.0.1; NO_PROXY listing loopback and the metadata server.

Usage: check_service.py FILE...   exit 1 with one line per problem.
"""

import json
import re
import sys

import yaml

CONTAINER_KEYS = {
    "name", "image", "command", "args", "env", "resources", "ports", "volumeMounts",
    "workingDir", "livenessProbe", "startupProbe",
}
PROBE_KEYS = {
    "httpGet", "tcpSocket", "grpc", "initialDelaySeconds", "timeoutSeconds", "periodSeconds",
    "failureThreshold",
}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
MEMORY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9, "": 1}
MIN_SIDECAR_MEMORY = 64 * 2**20


def memory_bytes(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|k|M|G|)", str(text))
    return float(m.group(1)) * MEMORY_UNITS[m.group(2)] if m else None


def env_map(container):
    return {e.get("name"): e.get("value") for e in container.get("env") or []}


def port_of(addr):
    host, _, port = (addr or "").rpartition(":")
    return host, int(port) if port.isdigit() else None


def check(doc):
    problems = []
    bad = problems.append
    if doc.get("apiVersion") != "serving.knative.dev/v1" or doc.get("kind") != "Service":
        bad("not a serving.knative.dev/v1 Service")
        return problems
    if not DNS_LABEL.match(str((doc.get("metadata") or {}).get("name", ""))):
        bad("metadata.name must be a DNS label")
    template = (doc.get("spec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    if not 1 <= len(containers) <= 10:
        bad(f"{len(containers)} containers; Cloud Run allows 1 to 10")
    by_name = {}
    for i, c in enumerate(containers):
        name = c.get("name", "")
        where = f"containers[{i}] ({name or 'unnamed'})"
        if not DNS_LABEL.match(name):
            bad(f"{where}: name must be a DNS label")
        if name in by_name:
            bad(f"{where}: duplicate name")
        by_name[name] = c
        for key in sorted(set(c) - CONTAINER_KEYS):
            bad(f"{where}: unknown field {key!r}")
        if not c.get("image"):
            bad(f"{where}: image is required")
        limits = (c.get("resources") or {}).get("limits") or {}
        if memory_bytes(limits.get("memory")) is None or "cpu" not in limits:
            bad(f"{where}: resources.limits needs memory and cpu")
        for probe_name in ("startupProbe", "livenessProbe"):
            probe = c.get(probe_name)
            if probe is not None:
                for key in sorted(set(probe) - PROBE_KEYS):
                    bad(f"{where}: {probe_name}: unsupported field {key!r} (no exec probes on Cloud Run)")
    ingress = [n for n, c in by_name.items() if c.get("ports")]
    if len(ingress) != 1:
        bad(f"exactly one container must have ports (the ingress container), found {ingress}")
    elif len(by_name[ingress[0]]["ports"]) != 1:
        bad(f"ingress container {ingress[0]}: exactly one port")
    problems += check_dependencies(annotations, by_name)
    sidecars = [n for n, c in by_name.items() if "egress-sidecar" in str(c.get("image", ""))]
    if len(sidecars) != 1:
        bad(f"expected one egress-sidecar container, found {sidecars}")
    elif len(ingress) == 1:
        problems += check_wiring(by_name[ingress[0]], by_name[sidecars[0]], annotations)
    return problems


def check_dependencies(annotations, by_name):
    problems = []
    raw = annotations.get("run.googleapis.com/container-dependencies")
    if raw is None:
        return ["run.googleapis.com/container-dependencies is missing (nothing orders startup)"]
    try:
        deps = json.loads(raw)
    except json.JSONDecodeError as e:
        return [f"run.googleapis.com/container-dependencies is not JSON: {e}"]
    if not isinstance(deps, dict) or not all(
        isinstance(v, list) and all(isinstance(x, str) for x in v) for v in deps.values()
    ):
        return ["run.googleapis.com/container-dependencies must map names to lists of names"]
    for name, needs in deps.items():
        for need in [name] + needs:
            if need not in by_name:
                problems.append(f"container-dependencies names {need!r}, which is no container")
        if name in needs:
            problems.append(f"container-dependencies: {name} depends on itself")
        for need in needs:
            if need in by_name and "startupProbe" not in by_name[need]:
                problems.append(f"{need}: depended on but has no startupProbe, so nothing is waited for")
    # Cycles: repeatedly drop containers whose dependencies are all dropped.
    left = {n: set(v) for n, v in deps.items()}
    while left:
        ready = [n for n, v in left.items() if not (v & set(left))]
        if not ready:
            problems.append(f"container-dependencies has a cycle among {sorted(left)}")
            break
        for n in ready:
            del left[n]
    return problems


def check_wiring(app, sidecar, annotations):
    problems = []
    bad = problems.append
    side_env = env_map(sidecar)
    try:
        deps = json.loads(annotations.get("run.googleapis.com/container-dependencies") or "{}")
    except json.JSONDecodeError:
        deps = {}
    needs = deps.get(app["name"], []) if isinstance(deps, dict) else []
    if sidecar["name"] not in needs:
        bad(f"{app['name']} must depend on {sidecar['name']} in container-dependencies")
    if sidecar.get("ports"):
        bad(f"{sidecar['name']}: a sidecar must not declare ports")
    probe = sidecar.get("startupProbe") or {}
    check_port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
    if check_port is None:
        bad(f"{sidecar['name']}: startupProbe needs httpGet or tcpSocket")
    else:
        reachable = {
            port_of(side_env.get(var))[1]
            for var in ("EGRESS_LISTEN", "EGRESS_ADMIN")
            if port_of(side_env.get(var))[0] == "0.0.0.0"
        }
        if check_port not in reachable:
            bad(f"{sidecar['name']}: probe port {check_port} is not bound on 0.0.0.0 "
                f"(EGRESS_LISTEN/EGRESS_ADMIN), so the probe cannot reach it")
        if "httpGet" in probe and probe["httpGet"].get("path") != "/readyz":
            bad(f"{sidecar['name']}: the httpGet probe should ask /readyz")
    memory = memory_bytes(((sidecar.get("resources") or {}).get("limits") or {}).get("memory"))
    if memory is not None and memory < MIN_SIDECAR_MEMORY:
        bad(f"{sidecar['name']}: memory limit under 64Mi")
    listen_host, listen_port = port_of(side_env.get("EGRESS_LISTEN", "127.0.0.1:15080"))
    app_env = env_map(app)
    want = f"http://127.0.0.1:{listen_port}"
    for var in ("HTTP_PROXY", "http_proxy"):
        if app_env.get(var) != want:
            bad(f"{app['name']}: {var} must be {want} (the sidecar's EGRESS_LISTEN)")
    if listen_host not in ("127.0.0.1", "0.0.0.0"):
        bad(f"{sidecar['name']}: EGRESS_LISTEN {listen_host} is not reachable from the app on 127.0.0.1")
    no_proxy = set((app_env.get("NO_PROXY") or "").split(","))
    for host in ("localhost", "127.0.0.1", "metadata.google.internal", "169.254.169.254"):
        if host not in no_proxy:
            bad(f"{app['name']}: NO_PROXY lacks {host}")
    return problems


def main(paths):
    failed = False
    for path in paths:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        problems = [] if docs else ["no documents"]
        for doc in docs:
            problems += check(doc)
        for p in problems:
            print(f"{path}: {p}", file=sys.stderr)
        if problems:
            failed = True
        else:
            print(f"{path}: valid Cloud Run multi-container service")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
