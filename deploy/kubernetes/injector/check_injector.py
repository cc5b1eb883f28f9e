#!/usr/bin/env python3
"""Checks what kubernetes-validate cannot in the injector manifests: the cert-manager objects
(no schema is bundled for CRDs) and the names that tie the objects together. A mismatch here
deploys cleanly and then fails at the first pod creation, so it is worth catching offline.

  - cert-manager Issuers and Certificates have the fields they need and no unknown ones;
    every issuerRef names an Issuer in the same namespace; a CA Issuer's secret is a CA
    Certificate's secret;
  - the MutatingWebhookConfiguration: admissionReviewVersions v1, sideEffects None, a
    failurePolicy, timeoutSeconds <= 10, CREATE of pods, path /inject; the objectSelector
    requires egress-sidecar.io/inject=true and matches none of the injector's own pods; the
    namespaceSelector excludes kube-system and the injector's namespace;
  - clientConfig.service names a Service whose port leads to the injector's container port;
  - cert-manager.io/inject-ca-from names a Certificate whose dnsNames cover
    <service>.<namespace>.svc and whose secret is mounted where --tls-cert/--tls-key point;
  - example workloads: labelled for injection, and a config-map annotation names a ConfigMap
    with a config.yaml key in the same files.

Usage: check_injector.py FILE...   exit 1 with one line per problem.
"""

import sys

import yaml

CERT_SPEC_KEYS = {
    "secretName", "issuerRef", "dnsNames", "ipAddresses", "uris", "commonName", "isCA",
    "duration", "renewBefore", "privateKey", "usages", "subject", "secretTemplate",
    "emailAddresses", "revisionHistoryLimit",
}
ISSUER_TYPES = {"selfSigned", "ca", "acme", "vault", "venafi"}
INJECT_LABEL = "egress-sidecar.io/inject"


def name_ns(obj):
    meta = obj.get("metadata") or {}
    return meta.get("name"), meta.get("namespace")


def selector_matches(selector, labels):
    """matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist) against labels."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def check(docs):
    problems = []
    bad = problems.append
    kinds = {}
    for d in docs:
        kinds.setdefault(d.get("kind"), []).append(d)
    issuers = {name_ns(i): i for i in kinds.get("Issuer", [])}
    certs = {name_ns(c): c for c in kinds.get("Certificate", [])}

    for (name, ns), issuer in issuers.items():
        types = set(issuer.get("spec") or {}) & ISSUER_TYPES
        if len(types) != 1 or set(issuer.get("spec") or {}) - ISSUER_TYPES:
            bad(f"Issuer {ns}/{name}: spec must be exactly one of {sorted(ISSUER_TYPES)}")
        ca = (issuer.get("spec") or {}).get("ca")
        if ca is not None and not any(
            c["spec"].get("isCA") and c["spec"].get("secretName") == ca.get("secretName")
            for (_, cns), c in certs.items() if cns == ns
        ):
            bad(f"Issuer {ns}/{name}: ca.secretName is no CA Certificate's secret")
    for (name, ns), cert in certs.items():
        spec = cert.get("spec") or {}
        for key in sorted(set(spec) - CERT_SPEC_KEYS):
            bad(f"Certificate {ns}/{name}: unknown field spec.{key}")
        if not spec.get("secretName"):
            bad(f"Certificate {ns}/{name}: spec.secretName is required")
        ref = spec.get("issuerRef") or {}
        if ref.get("kind", "Issuer") == "Issuer" and (ref.get("name"), ns) not in issuers:
            bad(f"Certificate {ns}/{name}: issuerRef {ref.get('name')} is no Issuer in {ns}")

    hooks = kinds.get("MutatingWebhookConfiguration", [])
    if not hooks:
        bad("no MutatingWebhookConfiguration")
    for cfg in hooks:
        problems += check_webhook_config(cfg, kinds, certs)

    config_maps = {name_ns(c)[0]: c for c in kinds.get("ConfigMap", [])}
    for dep in kinds.get("Deployment", []):
        tmpl = dep["spec"]["template"]
        labels = (tmpl.get("metadata") or {}).get("labels") or {}
        annotations = (tmpl.get("metadata") or {}).get("annotations") or {}
        if any(a.startswith("egress-sidecar.io/") for a in annotations) and labels.get(INJECT_LABEL) != "true":
            bad(f"Deployment {name_ns(dep)[0]}: has egress-sidecar.io annotations but no {INJECT_LABEL}=\"true\" label")
        cm = annotations.get("egress-sidecar.io/config-map")
        if cm is not None and "config.yaml" not in ((config_maps.get(cm) or {}).get("data") or {}):
            bad(f"Deployment {name_ns(dep)[0]}: config-map {cm} is not a ConfigMap with config.yaml here")
    return problems


def check_webhook_config(cfg, kinds, certs):
    problems = []
    bad = problems.append
    cfg_name = name_ns(cfg)[0]
    ca_from = ((cfg.get("metadata") or {}).get("annotations") or {}).get("cert-manager.io/inject-ca-from", "")
    ca_ns, _, ca_name = ca_from.partition("/")
    cert = certs.get((ca_name, ca_ns))
    if cert is None:
        bad(f"{cfg_name}: cert-manager.io/inject-ca-from {ca_from!r} is no Certificate here")
    for hook in cfg.get("webhooks") or []:
        where = f"{cfg_name}/{hook.get('name')}"
        if "v1" not in (hook.get("admissionReviewVersions") or []):
            bad(f"{where}: admissionReviewVersions must include v1 (the only version served)")
        if hook.get("sideEffects") not in ("None", "NoneOnDryRun"):
            bad(f"{where}: sideEffects must be None")
        if hook.get("failurePolicy") not in ("Ignore", "Fail"):
            bad(f"{where}: set failurePolicy explicitly")
        if not 1 <= int(hook.get("timeoutSeconds", 10)) <= 10:
            bad(f"{where}: timeoutSeconds must be 1..10")
        rules = hook.get("rules") or []
        if not any("CREATE" in r.get("operations", []) and "pods" in r.get("resources", []) for r in rules):
            bad(f"{where}: no rule for CREATE pods")
        obj_sel = hook.get("objectSelector") or {}
        if (obj_sel.get("matchLabels") or {}).get(INJECT_LABEL) != "true":
            bad(f"{where}: objectSelector must require {INJECT_LABEL}=\"true\"")
        excluded = set()
        for e in (hook.get("namespaceSelector") or {}).get("matchExpressions") or []:
            if e.get("key") == "kubernetes.io/metadata.name" and e.get("operator") == "NotIn":
                excluded |= set(e.get("values") or [])
        svc_ref = (hook.get("clientConfig") or {}).get("service") or {}
        svc_ns = svc_ref.get("namespace")
        for ns in ("kube-system", svc_ns):
            if ns not in excluded:
                bad(f"{where}: namespaceSelector does not exclude {ns}")
        if svc_ref.get("path") != "/inject":
            bad(f"{where}: clientConfig.service.path must be /inject")
        svc = next((s for s in kinds.get("Service", []) if name_ns(s) == (svc_ref.get("name"), svc_ns)), None)
        if svc is None:
            bad(f"{where}: clientConfig.service {svc_ns}/{svc_ref.get('name')} is no Service here")
            continue
        port = next((p for p in svc["spec"].get("ports", []) if p.get("port") == svc_ref.get("port", 443)), None)
        if port is None:
            bad(f"{where}: Service {svc_ref.get('name')} has no port {svc_ref.get('port', 443)}")
            continue
        backends = [
            d for d in kinds.get("Deployment", [])
            if name_ns(d)[1] == svc_ns
            and selector_matches({"matchLabels": svc["spec"].get("selector") or {}},
                                 d["spec"]["template"]["metadata"].get("labels") or {})
        ]
        if not backends:
            bad(f"{where}: Service {svc_ref.get('name')} selects no Deployment")
        for dep in backends:
            problems += check_backend(where, dep, port, obj_sel, cert, svc_ref)
    return problems


def check_backend(where, dep, svc_port, obj_sel, cert, svc_ref):
    problems = []
    bad = problems.append
    pod = dep["spec"]["template"]
    labels = pod["metadata"].get("labels") or {}
    if selector_matches(obj_sel, labels):
        bad(f"{where}: objectSelector matches the injector's own pods")
    target = svc_port.get("targetPort", svc_port.get("port"))
    containers = pod["spec"]["containers"]
    injector = next((c for c in containers
                     if any(p.get("name") == target or p.get("containerPort") == target for p in c.get("ports", []))),
                    None)
    if injector is None:
        bad(f"{where}: no container in {name_ns(dep)[0]} has port {target}")
        return problems
    args = injector.get("args") or []
    if not args or args[0] != "inject":
        bad(f"{where}: container {injector['name']} does not run `egress-sidecar inject`")
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    port_no = next(p["containerPort"] for p in injector["ports"] if p.get("name") == target or p.get("containerPort") == target)
    if not flags.get("--listen", "").endswith(f":{port_no}"):
        bad(f"{where}: --listen does not use container port {port_no}")
    if cert is None:
        return problems
    svc_dns = f"{svc_ref.get('name')}.{svc_ref.get('namespace')}.svc"
    if svc_dns not in (cert["spec"].get("dnsNames") or []):
        bad(f"{where}: Certificate dnsNames lack {svc_dns}, which the apiserver verifies")
    volume = next((v for v in pod["spec"].get("volumes", [])
                   if (v.get("secret") or {}).get("secretName") == cert["spec"].get("secretName")), None)
    if volume is None:
        bad(f"{where}: the Certificate's secret {cert['spec'].get('secretName')} is not mounted")
        return problems
    mount = next((m for m in injector.get("volumeMounts", []) if m["name"] == volume["name"]), None)
    if mount is None or "subPath" in mount:
        bad(f"{where}: mount the TLS secret as a directory (subPath mounts never see renewals)")
        return problems
    for flag, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key")):
        if flags.get(flag) != f"{mount['mountPath'].rstrip('/')}/{key}":
            bad(f"{where}: {flag} should be {mount['mountPath'].rstrip('/')}/{key}")
    return problems


def main(paths):
    docs = []
    for path in paths:
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    problems = check(docs)
    for p in problems:
        print(f"check_injector: {p}", file=sys.stderr)
    if not problems:
        print(f"check_injector: {', '.join(paths)}: consistent")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
