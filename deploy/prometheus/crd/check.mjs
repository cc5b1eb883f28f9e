// deploy/validate.sh's PrometheusRule schema check: each JSON file named on the command line (a
// manifest converted from YAML) must be a monitoring.coreos.com/v1 PrometheusRule that the
// CRD's OpenAPI schema accepts. The schema is prometheus-operator's, as compiled into
// validators by @kubernetes-models/prometheus-operator (pinned by package-lock.json): no
// cluster and no download at check time. Exits 1 naming every failure.
import { readFileSync } from "node:fs";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error("usage: node check.mjs MANIFEST.json...");
  process.exit(2);
}
let failed = 0;
for (const file of files) {
  const doc = JSON.parse(readFileSync(file, "utf8"));
  const problems = [];
  // The model sets apiVersion and kind itself: a manifest of another kind must not pass as one.
  if (doc?.apiVersion !== PrometheusRule.apiVersion || doc?.kind !== PrometheusRule.kind) {
    problems.push(`not a ${PrometheusRule.apiVersion} ${PrometheusRule.kind}: ${doc?.apiVersion} ${doc?.kind}`);
  }
  if (!doc?.spec?.groups?.length) {
    problems.push("spec.groups is empty");
  }
  try {
    new PrometheusRule(doc).validate();
  } catch (err) {
    problems.push(err.message);
  }
  if (problems.length) {
    failed++;
    console.error(`${file}: ${problems.join("; ")}`);
  } else {
    console.log(`${file}: a valid PrometheusRule (${doc.spec.groups.length} group(s))`);
  }
}
process.exit(failed ? 1 : 0);
