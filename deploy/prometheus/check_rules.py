#!/usr/bin/env python3
"""deploy/validate.sh's check of the alert rules beyond promtool: the PrometheusRule manifest
carries the rule file's groups exactly (parsed, compared as data), every alert has a severity,
a summary, a description and a runbook_url naming a heading of the README's Runbook.

usage: check_rules.py RULES.yaml MANIFEST.yaml --readme README.md [--json OUT]
--json writes the manifest as JSON, for the CRD schema check (crd/check.mjs).
"""
import argparse
import json
import re
import sys

import yaml


def first_difference(a, b, path="groups"):
    """Where two parsed YAML values first differ, for the message."""
    if type(a) is not type(b):
        return f"{path}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}: only in {'the rule file' if key in a else 'the manifest'}"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        if len(a) != len(b):
            return f"{path}: {len(a)} items in the rule file, {len(b)} in the manifest"
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def github_anchor(heading):
    """The anchor GitHub gives a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rules")
    ap.add_argument("manifest")
    ap.add_argument("--readme", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()
    problems = []

    rules = yaml.safe_load(open(args.rules))
    docs = [d for d in yaml.safe_load_all(open(args.manifest)) if d is not None]
    if len(docs) != 1:
        sys.exit(f"{args.manifest}: {len(docs)} documents, want the one PrometheusRule")
    manifest = docs[0]
    if (manifest.get("apiVersion"), manifest.get("kind")) != ("monitoring.coreos.com/v1", "PrometheusRule"):
        problems.append(f"{args.manifest}: not a monitoring.coreos.com/v1 PrometheusRule")
    if not (manifest.get("metadata") or {}).get("labels", {}).get("release"):
        problems.append(f"{args.manifest}: no metadata.labels.release (kube-prometheus-stack's ruleSelector)")
    groups = rules.get("groups") or []
    diff = first_difference(groups, (manifest.get("spec") or {}).get("groups"))
    if diff:
        problems.append(f"{args.manifest}: spec.groups differ from {args.rules}'s groups at {diff}")

    anchors = {
        github_anchor(line.lstrip("#"))
        for line in open(args.readme)
        if re.match(r"#{2,4} ", line)
    }
    alerts = [r for g in groups for r in g.get("rules") or [] if "alert" in r]
    if not alerts:
        problems.append(f"{args.rules}: no alerts")
    for group in groups:
        if not str(group.get("name", "")).startswith("egress-sidecar"):
            problems.append(f"group {group.get('name')!r}: its name must start with egress-sidecar")
    for rule in alerts:
        name = rule["alert"]
        if not (rule.get("labels") or {}).get("severity"):
            problems.append(f"{name}: no labels.severity")
        notes = rule.get("annotations") or {}
        for key in ("summary", "description", "runbook_url"):
            if not notes.get(key):
                problems.append(f"{name}: no annotations.{key}")
        url = notes.get("runbook_url", "")
        want = f"README.md#{name.lower()}"
        if url != want:
            problems.append(f"{name}: runbook_url {url!r}, want {want!r}")
        elif name.lower() not in anchors:
            problems.append(f"{name}: {args.readme} has no heading '{name}' for its runbook_url")

    if problems:
        sys.exit("\n".join(problems))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(manifest, out)
    print(f"{len(alerts)} alerts: manifest in sync, each with severity, summary, description and a runbook")


if __name__ == "__main__":
    main()
