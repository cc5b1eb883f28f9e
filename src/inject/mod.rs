//! Sidecar injection: turns a Kubernetes `AdmissionReview` (v1) for a Pod into the JSON Patch
//! that adds the egress sidecar and points the application containers at it.
//!
//! A pod opts in with the label `egress-sidecar.io/inject: "true"` (a label, so that the
//! webhook's `objectSelector` keeps the apiserver from calling us for any other pod). It gets:
//! - the sidecar, as a native sidecar (first in `initContainers`, `restartPolicy: Always`, so
//!   the app starts only once the sidecar's startup probe passes and stops before it), or as a
//!   classic container when `egress-sidecar.io/mode: classic` asks (clusters before 1.29);
//! - on every application container, `HTTP_PROXY` + `http_proxy` unless it sets either, and
//!   `NO_PROXY` unless it sets `NO_PROXY` or `no_proxy`. User env is never changed;
//! - the annotation `egress-sidecar.io/status: injected`, so a second review adds no sidecar.
//!
//! Bad input never fails the pod: anything this module cannot read is allowed unchanged with
//! a warning, because refusing would block pod creation for a reason the user cannot fix.
//!
//! Only what the patch needs is modelled (names, labels, annotations, env names); the rest of
//! the pod passes through as JSON untouched. Serving HTTPS is in [`server`].

pub mod server;

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Pod label that opts a pod in.
pub const INJECT_LABEL: &str = "egress-sidecar.io/inject";
/// Annotation we set on injected pods; a pod that has it gets no second sidecar.
pub const STATUS_ANNOTATION: &str = "egress-sidecar.io/status";
/// Annotation: `native` or `classic`.
pub const MODE_ANNOTATION: &str = "egress-sidecar.io/mode";
/// Annotation: a ConfigMap whose `config.yaml` key is the sidecar's config file.
pub const CONFIG_MAP_ANNOTATION: &str = "egress-sidecar.io/config-map";
/// Annotation: the sidecar image.
pub const IMAGE_ANNOTATION: &str = "egress-sidecar.io/image";
/// Annotation: the sidecar's CPU request.
pub const CPU_REQUEST_ANNOTATION: &str = "egress-sidecar.io/cpu-request";
/// Annotation: the sidecar's memory request.
pub const MEMORY_REQUEST_ANNOTATION: &str = "egress-sidecar.io/memory-request";
/// Annotation: the sidecar's memory limit.
pub const MEMORY_LIMIT_ANNOTATION: &str = "egress-sidecar.io/memory-limit";
/// Annotation: hosts the sidecar reaches over TLS when apps send plain `http://`
/// (`EGRESS_TLS_HOSTS`).
pub const TLS_HOSTS_ANNOTATION: &str = "egress-sidecar.io/tls-hosts";
/// Annotation: the `NO_PROXY` value given to application containers.
pub const NO_PROXY_ANNOTATION: &str = "egress-sidecar.io/no-proxy";

/// The injected container's name.
pub const SIDECAR_NAME: &str = "egress-sidecar";
/// Where application containers send plain-HTTP egress. Fixed: the sidecar is started with
/// `EGRESS_LISTEN` set to match, whatever its config file says.
pub const PROXY_URL: &str = "http://127.0.0.1:15080";
/// The sidecar's listen and admin addresses inside the pod.
pub const SIDECAR_LISTEN: &str = "127.0.0.1:15080";
/// See [`SIDECAR_LISTEN`]; loopback only, so exec probes (not kubelet `httpGet`) check it.
pub const SIDECAR_ADMIN: &str = "127.0.0.1:15081";
/// Loopback, in-cluster names, and the cloud metadata servers (credentials must not go through
/// an egress policy that blocks link-local addresses).
pub const DEFAULT_NO_PROXY: &str =
    "localhost,127.0.0.1,::1,.svc,.cluster.local,169.254.169.254,metadata.google.internal";
/// The binary's path in the image the Dockerfile builds.
pub const SIDECAR_BINARY: &str = "/usr/local/bin/egress-sidecar";
/// Where the ConfigMap is mounted in the sidecar.
const CONFIG_DIR: &str = "/etc/egress-sidecar";
const CONFIG_VOLUME: &str = "egress-sidecar-config";
/// The AdmissionReview version we speak.
const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";
/// Kubernetes shows warnings longer than this truncated; keep ours whole.
const MAX_WARNING_CHARS: usize = 200;

/// How the sidecar is added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// An init container with `restartPolicy: Always` (Kubernetes 1.29+).
    Native,
    /// A regular container, first in `containers` (any Kubernetes version).
    Classic,
}

impl Mode {
    /// `native` or `classic`.
    pub fn parse(text: &str) -> Option<Mode> {
        match text {
            "native" => Some(Mode::Native),
            "classic" => Some(Mode::Classic),
            _ => None,
        }
    }
}

/// The injector's defaults; per-pod annotations override each of them.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Sidecar image.
    pub image: String,
    /// Native or classic sidecar.
    pub mode: Mode,
    /// ConfigMap with the sidecar's `config.yaml`; none = built-in defaults.
    pub config_map: Option<String>,
    /// CPU request (no CPU limit: throttling a proxy adds latency to every request).
    pub cpu_request: String,
    /// Memory request.
    pub memory_request: String,
    /// Memory limit.
    pub memory_limit: String,
    /// `EGRESS_TLS_HOSTS` for the sidecar.
    pub tls_hosts: Option<String>,
    /// `NO_PROXY` for application containers.
    pub no_proxy: String,
}

/// A setting that cannot be used, naming the flag or annotation.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct SettingError {
    /// The flag or annotation.
    pub key: String,
    /// What is wrong with its value.
    pub problem: String,
}

impl Settings {
    /// Checks every value the way the apiserver would, so a bad default fails at startup
    /// instead of in every patched pod.
    pub fn validate(&self) -> Result<(), SettingError> {
        let bad = |key: &str, problem: String| SettingError {
            key: key.to_owned(),
            problem,
        };
        check_image(&self.image).map_err(|p| bad("--image", p))?;
        for (key, value) in [
            ("--cpu-request", &self.cpu_request),
            ("--memory-request", &self.memory_request),
            ("--memory-limit", &self.memory_limit),
        ] {
            check_quantity(value).map_err(|p| bad(key, p))?;
        }
        if let Some(name) = &self.config_map {
            check_dns_name(name).map_err(|p| bad("--config-map", p))?;
        }
        if let Some(hosts) = &self.tls_hosts {
            check_tls_hosts(hosts).map_err(|p| bad("--tls-hosts", p))?;
        }
        Ok(())
    }
}

// === wire format ===

/// What the apiserver sends: only the parts we read.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn {
    api_version: Option<String>,
    kind: Option<String>,
    request: Option<RequestIn>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn {
    uid: String,
    kind: Option<KindIn>,
    operation: Option<String>,
    namespace: Option<String>,
    object: Option<PodIn>,
}

#[derive(Debug, Deserialize)]
struct KindIn {
    #[serde(default)]
    group: String,
    kind: String,
}

#[derive(Debug, Default, Deserialize)]
struct PodIn {
    #[serde(default)]
    metadata: MetaIn,
    #[serde(default)]
    spec: SpecIn,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaIn {
    name: Option<String>,
    generate_name: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecIn {
    containers: Option<Vec<ContainerIn>>,
    init_containers: Option<Vec<ContainerIn>>,
    volumes: Option<Vec<NamedIn>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerIn {
    name: String,
    env: Option<Vec<NamedIn>>,
    env_from: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
struct NamedIn {
    name: String,
}

/// The `AdmissionReview` we answer with.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReviewOut {
    api_version: &'static str,
    kind: &'static str,
    /// The verdict.
    pub response: AdmissionResponse,
}

/// `response` of an `AdmissionReview`. We always allow; a patch is present when we change the
/// pod.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    /// The request's uid (empty when the request was unreadable).
    pub uid: String,
    /// Always true.
    pub allowed: bool,
    /// `JSONPatch` when `patch` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<&'static str>,
    /// Base64 of the RFC 6902 patch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// Shown to the user by kubectl.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A reviewed request: the answer and a line for the log.
#[derive(Debug)]
pub struct Outcome {
    /// The AdmissionReview to send back.
    pub review: ReviewOut,
    /// `namespace/name`, or what we know of it.
    pub pod: String,
    /// What was done: `injected`, `env only`, or why nothing was.
    pub action: String,
}

/// Why a request body is not something we can patch.
#[derive(Debug, thiserror::Error)]
enum ReviewError {
    #[error("request body is not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("not an admission.k8s.io/v1 AdmissionReview (apiVersion {api_version:?}, kind {kind:?})")]
    NotReview { api_version: String, kind: String },
    #[error("AdmissionReview cannot be read: {0}")]
    Shape(serde_json::Error),
    #[error("AdmissionReview has no request")]
    NoRequest,
    #[error("AdmissionReview request has no object")]
    NoObject,
}

// === review ===

/// Answers one AdmissionReview body. Never fails: unreadable input is allowed unchanged with a
/// warning.
pub fn review(body: &[u8], settings: &Settings) -> Outcome {
    // The uid is read on its own first, so that even a request we cannot otherwise use gets
    // an answer the apiserver accepts as belonging to it.
    let value: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return unreadable(String::new(), ReviewError::NotJson(e)),
    };
    let uid = value
        .pointer("/request/uid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    match parse(value) {
        Ok(request) => review_request(request, settings),
        Err(e) => unreadable(uid, e),
    }
}

fn parse(value: Value) -> Result<RequestIn, ReviewError> {
    let review: ReviewIn = serde_json::from_value(value).map_err(ReviewError::Shape)?;
    let api_version = review.api_version.unwrap_or_default();
    let kind = review.kind.unwrap_or_default();
    if api_version != REVIEW_API_VERSION || kind != "AdmissionReview" {
        return Err(ReviewError::NotReview { api_version, kind });
    }
    review.request.ok_or(ReviewError::NoRequest)
}

fn unreadable(uid: String, error: ReviewError) -> Outcome {
    let warning = format!("egress-sidecar injector: pod not changed: {error}");
    Outcome {
        review: answer(uid, None, vec![warning]),
        pod: "?".into(),
        action: format!("not changed: {error}"),
    }
}

fn review_request(request: RequestIn, settings: &Settings) -> Outcome {
    let RequestIn {
        uid,
        kind,
        operation,
        namespace,
        object,
    } = request;
    let is_pod = kind
        .as_ref()
        .is_none_or(|k| k.group.is_empty() && k.kind == "Pod");
    if !is_pod || operation.as_deref().is_some_and(|op| op != "CREATE") {
        let what = kind.map(|k| k.kind).unwrap_or_default();
        return Outcome {
            review: answer(uid, None, Vec::new()),
            pod: "?".into(),
            action: format!(
                "not changed: {} {what} is not a pod CREATE",
                operation.unwrap_or_default()
            ),
        };
    }
    let Some(pod) = object else {
        return unreadable(uid, ReviewError::NoObject);
    };
    let name = pod
        .metadata
        .name
        .clone()
        .or_else(|| pod.metadata.generate_name.as_ref().map(|g| format!("{g}*")))
        .unwrap_or_default();
    let pod_name = format!("{}/{name}", namespace.unwrap_or_default());
    let plan = plan(&pod, settings);
    let patch = (!plan.ops.is_empty()).then_some(Value::Array(plan.ops));
    Outcome {
        review: answer(uid, patch, plan.warnings),
        pod: pod_name,
        action: plan.action,
    }
}

fn answer(uid: String, patch: Option<Value>, warnings: Vec<String>) -> ReviewOut {
    let patch = patch.map(|p| base64::engine::general_purpose::STANDARD.encode(p.to_string()));
    ReviewOut {
        api_version: REVIEW_API_VERSION,
        kind: "AdmissionReview",
        response: AdmissionResponse {
            uid,
            allowed: true,
            patch_type: patch.as_ref().map(|_| "JSONPatch"),
            patch,
            warnings: warnings.into_iter().map(clip).collect(),
        },
    }
}

fn clip(mut warning: String) -> String {
    if let Some((at, _)) = warning.char_indices().nth(MAX_WARNING_CHARS) {
        warning.truncate(at);
        warning.push('…');
    }
    warning
}

// === the patch ===

/// The patch operations for one pod, with what to tell the user.
#[derive(Debug, Default)]
struct Plan {
    ops: Vec<Value>,
    warnings: Vec<String>,
    action: String,
}

fn plan(pod: &PodIn, settings: &Settings) -> Plan {
    let labels = pod.metadata.labels.as_ref();
    if labels.and_then(|l| l.get(INJECT_LABEL)).map(String::as_str) != Some("true") {
        return Plan {
            action: format!("not changed: no label {INJECT_LABEL}=\"true\""),
            ..Plan::default()
        };
    }
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let mut plan = Plan::default();
    let pod_settings = per_pod(settings, annotations, &mut plan.warnings);
    let containers = pod.spec.containers.as_deref().unwrap_or_default();
    let init = pod.spec.init_containers.as_deref().unwrap_or_default();
    let present = annotations.contains_key(STATUS_ANNOTATION)
        || containers.iter().chain(init).any(|c| c.name == SIDECAR_NAME);

    // Env first: the classic sidecar goes in at index 0 and would shift these indices.
    for (i, c) in containers.iter().enumerate() {
        if c.name != SIDECAR_NAME {
            env_ops(i, c, &pod_settings.no_proxy, &mut plan);
        }
    }
    let env_changed = !plan.ops.is_empty();
    if !present {
        add_sidecar(pod, &pod_settings, &mut plan);
    }
    plan.action = match (present, env_changed) {
        (false, _) => format!("injected ({:?})", pod_settings.mode).to_lowercase(),
        (true, true) => "sidecar present; proxy env added to new containers".into(),
        (true, false) => "not changed: already injected".into(),
    };
    plan
}

/// Settings for one pod: the defaults, overridden by its annotations. An unusable annotation is
/// ignored with a warning rather than failing the pod.
fn per_pod(
    defaults: &Settings,
    annotations: &BTreeMap<String, String>,
    warnings: &mut Vec<String>,
) -> Settings {
    let mut s = defaults.clone();
    let mut take = |key: &str, check: fn(&str) -> Result<(), String>| -> Option<String> {
        let value = annotations.get(key)?.trim();
        match check(value) {
            Ok(()) => Some(value.to_owned()),
            Err(problem) => {
                warnings.push(format!(
                    "egress-sidecar injector: annotation {key} ignored: {problem}"
                ));
                None
            }
        }
    };
    if let Some(mode) = take(MODE_ANNOTATION, |v| {
        Mode::parse(v)
            .map(|_| ())
            .ok_or_else(|| format!("{v:?} is not native or classic"))
    }) {
        s.mode = Mode::parse(&mode).unwrap_or(s.mode);
    }
    if let Some(v) = take(CONFIG_MAP_ANNOTATION, check_dns_name) {
        s.config_map = Some(v);
    }
    if let Some(v) = take(IMAGE_ANNOTATION, check_image) {
        s.image = v;
    }
    if let Some(v) = take(CPU_REQUEST_ANNOTATION, check_quantity) {
        s.cpu_request = v;
    }
    if let Some(v) = take(MEMORY_REQUEST_ANNOTATION, check_quantity) {
        s.memory_request = v;
    }
    if let Some(v) = take(MEMORY_LIMIT_ANNOTATION, check_quantity) {
        s.memory_limit = v;
    }
    if let Some(v) = take(TLS_HOSTS_ANNOTATION, check_tls_hosts) {
        s.tls_hosts = Some(v);
    }
    if let Some(v) = take(NO_PROXY_ANNOTATION, |v| {
        if v.chars().any(char::is_whitespace) {
            Err("contains whitespace".into())
        } else {
            Ok(())
        }
    }) {
        s.no_proxy = v;
    }
    s
}

/// Proxy env for container `i`. `HTTP_PROXY`/`http_proxy` and `NO_PROXY`/`no_proxy` are each
/// one setting in two spellings: a container that sets either spelling keeps its own, so no
/// client in it sees a mix of ours and its own.
fn env_ops(i: usize, container: &ContainerIn, no_proxy: &str, plan: &mut Plan) {
    if container.env_from.as_ref().is_some_and(|f| !f.is_empty()) {
        // An explicit env entry beats envFrom, and we cannot see what envFrom brings in: adding
        // HTTP_PROXY could override the user's own.
        plan.warnings.push(format!(
            "egress-sidecar injector: container {:?} uses envFrom, so HTTP_PROXY/NO_PROXY were not added \
             (set them in its env)",
            container.name
        ));
        return;
    }
    let names: Vec<&str> = container.env.iter().flatten().map(|e| e.name.as_str()).collect();
    let sets = |a: &str, b: &str| names.contains(&a) || names.contains(&b);
    let mut add = Vec::new();
    if !sets("HTTP_PROXY", "http_proxy") {
        add.push(json!({"name": "HTTP_PROXY", "value": PROXY_URL}));
        add.push(json!({"name": "http_proxy", "value": PROXY_URL}));
    }
    if !sets("NO_PROXY", "no_proxy") {
        add.push(json!({"name": "NO_PROXY", "value": no_proxy}));
    }
    if add.is_empty() {
        return;
    }
    let path = format!("/spec/containers/{i}/env");
    append(&mut plan.ops, &path, container.env.is_some(), add);
}

fn add_sidecar(pod: &PodIn, s: &Settings, plan: &mut Plan) {
    let containers = pod.spec.containers.as_deref().unwrap_or_default();
    let mut annotations = vec![(STATUS_ANNOTATION, "injected".to_owned())];
    let existing = pod.metadata.annotations.as_ref();
    // In classic mode the sidecar becomes the first container, which kubectl logs/exec would
    // otherwise pick by default.
    const DEFAULT_CONTAINER: &str = "kubectl.kubernetes.io/default-container";
    if s.mode == Mode::Classic && !existing.is_some_and(|a| a.contains_key(DEFAULT_CONTAINER)) {
        if let Some(first) = containers.first() {
            annotations.push((DEFAULT_CONTAINER, first.name.clone()));
        }
    }
    annotation_ops(existing.is_some(), &annotations, &mut plan.ops);

    if let Some(map) = &s.config_map {
        let volumes = pod.spec.volumes.as_deref();
        if !volumes.is_some_and(|v| v.iter().any(|v| v.name == CONFIG_VOLUME)) {
            let volume = json!({"name": CONFIG_VOLUME, "configMap": {"name": map}});
            append(&mut plan.ops, "/spec/volumes", volumes.is_some(), vec![volume]);
        }
    }
    let sidecar = sidecar_container(s);
    match s.mode {
        Mode::Native => {
            // First among init containers, so later init containers can use the proxy too.
            insert_first(
                &mut plan.ops,
                "/spec/initContainers",
                pod.spec.init_containers.is_some(),
                sidecar,
            )
        }
        Mode::Classic => {
            // First in `containers`: the kubelet starts containers in order, so the proxy gets
            // a head start (nothing makes the app wait for it in this form).
            insert_first(
                &mut plan.ops,
                "/spec/containers",
                pod.spec.containers.is_some(),
                sidecar,
            )
        }
    }
}

/// The sidecar container. Exec probes, because the kubelet's `httpGet` probes go to the pod IP
/// and the admin listener is on loopback.
fn sidecar_container(s: &Settings) -> Value {
    let mut env = vec![
        json!({"name": "EGRESS_LISTEN", "value": SIDECAR_LISTEN}),
        json!({"name": "EGRESS_ADMIN", "value": SIDECAR_ADMIN}),
        json!({"name": "EGRESS_LOG_FORMAT", "value": "json"}),
    ];
    let mut mounts = Vec::new();
    if s.config_map.is_some() {
        env.push(json!({"name": "EGRESS_CONFIG", "value": format!("{CONFIG_DIR}/config.yaml")}));
        mounts.push(json!({"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": true}));
    }
    if let Some(hosts) = &s.tls_hosts {
        env.push(json!({"name": "EGRESS_TLS_HOSTS", "value": hosts}));
    }
    let healthcheck = json!({"command": [SIDECAR_BINARY, "healthcheck"]});
    let mut c = json!({
        "name": SIDECAR_NAME,
        "image": s.image,
        "args": ["run"],
        "env": env,
        "startupProbe": {"exec": healthcheck, "periodSeconds": 1, "timeoutSeconds": 3, "failureThreshold": 30},
        "readinessProbe": {"exec": healthcheck, "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 3},
        "resources": {
            "requests": {"cpu": s.cpu_request, "memory": s.memory_request},
            "limits": {"memory": s.memory_limit},
        },
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    });
    if !mounts.is_empty() {
        c["volumeMounts"] = Value::Array(mounts);
    }
    if s.mode == Mode::Native {
        c["restartPolicy"] = json!("Always");
    }
    c
}

// === JSON Patch helpers ===

/// Appends `items` to the array at `path`; `/-` only works on an array that exists, so a
/// missing one is added whole.
fn append(ops: &mut Vec<Value>, path: &str, exists: bool, items: Vec<Value>) {
    if exists {
        for item in items {
            ops.push(json!({"op": "add", "path": format!("{path}/-"), "value": item}));
        }
    } else {
        ops.push(json!({"op": "add", "path": path, "value": items}));
    }
}

fn insert_first(ops: &mut Vec<Value>, path: &str, exists: bool, item: Value) {
    if exists {
        ops.push(json!({"op": "add", "path": format!("{path}/0"), "value": item}));
    } else {
        ops.push(json!({"op": "add", "path": path, "value": [item]}));
    }
}

fn annotation_ops(exists: bool, entries: &[(&str, String)], ops: &mut Vec<Value>) {
    if exists {
        for (key, value) in entries {
            let path = format!("/metadata/annotations/{}", escape_pointer(key));
            ops.push(json!({"op": "add", "path": path, "value": value}));
        }
    } else {
        let map: serde_json::Map<String, Value> =
            entries.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": map}));
    }
}

/// RFC 6901: `~` is `~0` and `/` is `~1` in a pointer segment (annotation keys contain `/`).
fn escape_pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

// === value checks (what the apiserver would reject after our patch) ===

/// A Kubernetes resource quantity: `50m`, `32Mi`, `0.5`, `1e3`.
fn check_quantity(text: &str) -> Result<(), String> {
    const SUFFIXES: [&str; 15] = [
        "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E",
    ];
    let bad = || Err(format!("{text:?} is not a quantity (e.g. 50m, 64Mi)"));
    let unsigned = text.strip_prefix('+').unwrap_or(text);
    let number_end = unsigned
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(unsigned.len());
    let (number, suffix) = unsigned.split_at(number_end);
    let digits = number.replace('.', "");
    if digits.is_empty() || number.matches('.').count() > 1 {
        return bad();
    }
    let exponent_ok = suffix
        .strip_prefix(['e', 'E'])
        .map(|e| e.strip_prefix(['+', '-']).unwrap_or(e))
        .is_some_and(|e| !e.is_empty() && e.chars().all(|c| c.is_ascii_digit()));
    if suffix.is_empty() || SUFFIXES.contains(&suffix) || exponent_ok {
        Ok(())
    } else {
        bad()
    }
}

/// A DNS-1123 subdomain (ConfigMap names).
fn check_dns_name(text: &str) -> Result<(), String> {
    let ok = !text.is_empty()
        && text.len() <= 253
        && text.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!("{text:?} is not a valid object name"))
    }
}

fn check_image(text: &str) -> Result<(), String> {
    if text.is_empty() || text.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Err(format!("{text:?} is not an image reference"))
    } else {
        Ok(())
    }
}

/// The same rule the sidecar applies to `EGRESS_TLS_HOSTS`, so a bad list is caught here
/// instead of crash-looping the sidecar.
fn check_tls_hosts(text: &str) -> Result<(), String> {
    for host in text.split(',').map(str::trim).filter(|h| !h.is_empty()) {
        if rustls::pki_types::ServerName::try_from(host).is_err() {
            return Err(format!("{host:?} is not a host name"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        for ok in ["50m", "32Mi", "1", "0.5", "1e3", "128M", "+2Gi", ".5"] {
            assert!(check_quantity(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Mi", "32 Mi", "32MB", "1.2.3", "-", "1e", "abc", "32mi"] {
            assert!(check_quantity(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names() {
        assert!(check_dns_name("egress-sidecar.v1").is_ok());
        for bad in ["", "Upper", "-x", "x-", "a..b", "a_b"] {
            assert!(check_dns_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pointer_escaping() {
        assert_eq!(
            escape_pointer("egress-sidecar.io/status"),
            "egress-sidecar.io~1status"
        );
        assert_eq!(escape_pointer("a~b/c"), "a~0b~1c");
    }

    #[test]
    fn long_warnings_are_clipped() {
        let w = clip("x".repeat(500));
        assert_eq!(w.chars().count(), MAX_WARNING_CHARS + 1);
        assert_eq!(clip("short".into()), "short");
    }
}
