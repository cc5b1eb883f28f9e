//! The injection webhook over real TLS on 127.0.0.1:0: AdmissionReview fixtures
//! (`tests/fixtures/admission/`) go in as the apiserver sends them, the returned JSON Patch is
//! applied to the pod with the `json-patch` crate, and the result is read back as a k8s-openapi
//! `Pod`, so the test sees what the kubelet would run.
//!
//! `EGRESS_INJECT_DUMP=DIR` writes the patched pods there as YAML-compatible JSON, for
//! deploy/validate.sh to check against the Kubernetes schemas (1.33 native, 1.28 classic).

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use egress_sidecar::inject::server::{self, TlsFiles};
use egress_sidecar::inject::{Mode, Settings, DEFAULT_NO_PROXY, PROXY_URL};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::Value;
use support::TempDir;
use tokio::sync::oneshot;

/// The DNS name the apiserver checks: `<service>.<namespace>.svc`.
const WEBHOOK_NAME: &str = "egress-sidecar-injector.egress-sidecar.svc";
const IMAGE: &str = "registry.example/egress-sidecar:test";

fn settings() -> Settings {
    Settings {
        image: IMAGE.into(),
        mode: Mode::Native,
        config_map: None,
        cpu_request: "50m".into(),
        memory_request: "32Mi".into(),
        memory_limit: "128Mi".into(),
        tls_hosts: None,
        no_proxy: DEFAULT_NO_PROXY.into(),
    }
}

// === a CA, a webhook, a client ===

struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// Writes a leaf certificate for `name` and its key as PEM files (cert-manager's names).
    fn write_leaf(&self, dir: &TempDir, name: &str) -> TlsFiles {
        let params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let files = TlsFiles {
            cert: dir.path.join("tls.crt"),
            key: dir.path.join("tls.key"),
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }
}

struct Webhook {
    addr: SocketAddr,
    ca: Ca,
    files: TlsFiles,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    _dir: TempDir,
}

impl Webhook {
    async fn start(settings: Settings) -> Webhook {
        let dir = TempDir::new();
        let ca = Ca::new("webhook test CA");
        let files = ca.write_leaf(&dir, WEBHOOK_NAME);
        let tls = server::watch_tls(files.clone(), Duration::from_millis(50)).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(server::serve(
            listener,
            tls,
            Arc::new(settings),
            shutdown,
            Duration::ZERO,
        ));
        Webhook {
            addr,
            ca,
            files,
            stop: Some(stop),
            task,
            _dir: dir,
        }
    }

    async fn post(&self, body: impl Into<Bytes>) -> Reply {
        request(self.addr, &self.ca.pem, "POST", "/inject", body.into()).await
    }

    /// Sends `fixture` and returns the reply's AdmissionReview.
    async fn review(&self, fixture: &str) -> Value {
        let reply = self.post(read_fixture(fixture)).await;
        assert_eq!(reply.status, 200, "{fixture}: {}", reply.body);
        assert_eq!(reply.content_type.as_deref(), Some("application/json"));
        serde_json::from_str(&reply.body).unwrap()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the webhook stops within 10s")
            .unwrap();
    }
}

struct Reply {
    status: u16,
    content_type: Option<String>,
    allow: Option<String>,
    body: String,
}

/// One HTTPS request on a new connection, verifying the server as `WEBHOOK_NAME` against `ca_pem`
/// the way the apiserver does with the webhook's caBundle.
async fn request(addr: SocketAddr, ca_pem: &str, method: &str, path: &str, body: Bytes) -> Reply {
    let (tls, _) = connect(addr, ca_pem).await.expect("TLS handshake");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(format!("https://{WEBHOOK_NAME}{path}?timeout=10s"))
        .header("host", WEBHOOK_NAME)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .expect("an answer within 10s")
        .unwrap();
    let header = |name: &str| resp.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
    let (status, content_type, allow) = (resp.status().as_u16(), header("content-type"), header("allow"));
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        content_type,
        allow,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}

/// Sends `head` over TLS and returns the response head.
async fn raw_head(addr: SocketAddr, ca_pem: &str, head: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut tls, _) = connect(addr, ca_pem).await.unwrap();
    tls.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf))
            .await
            .expect("a response head within 5s")
            .unwrap();
        assert!(
            n > 0,
            "closed before a response head: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A verified TLS connection; also returns the server's leaf certificate.
async fn connect(
    addr: SocketAddr,
    ca_pem: &str,
) -> std::io::Result<(tokio_rustls::client::TlsStream<tokio::net::TcpStream>, Vec<u8>)> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from(WEBHOOK_NAME).unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    Ok((tls, leaf))
}

// === fixtures and patches ===

fn read_fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/admission/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn fixture_pod(name: &str) -> Value {
    let review: Value = serde_json::from_str(&read_fixture(name)).unwrap();
    review["request"]["object"].clone()
}

/// The response's JSON Patch, decoded (None when the pod is not changed).
fn patch_of(review: &Value) -> Option<json_patch::Patch> {
    let response = &review["response"];
    let patch = response.get("patch")?.as_str().unwrap();
    assert_eq!(response["patchType"], "JSONPatch");
    let bytes = base64::engine::general_purpose::STANDARD.decode(patch).unwrap();
    Some(serde_json::from_slice(&bytes).unwrap())
}

/// Applies the reply's patch to the fixture's pod and reads the result as a k8s-openapi Pod.
fn patched(fixture: &str, review: &Value) -> (Value, Pod) {
    let mut pod = fixture_pod(fixture);
    let patch = patch_of(review).unwrap_or_else(|| panic!("{fixture}: no patch in {review}"));
    json_patch::patch(&mut pod, &patch).unwrap_or_else(|e| panic!("{fixture}: patch does not apply: {e}"));
    let native = pod["spec"]["initContainers"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["name"] == "egress-sidecar"));
    dump(
        &format!("{}-{fixture}", if native { "native" } else { "classic" }),
        &pod,
    );
    let typed: Pod = serde_json::from_value(pod.clone()).unwrap();
    (pod, typed)
}

/// Writes the patched pod as `native-<fixture>` or `classic-<fixture>`, by the form it got,
/// named as the apiserver would name it from `generateName` (validators want a name).
fn dump(name: &str, pod: &Value) {
    if let Some(dir) = std::env::var_os("EGRESS_INJECT_DUMP") {
        let mut pod = pod.clone();
        if pod["metadata"].get("name").is_none() {
            let generated = format!(
                "{}x7k2q",
                pod["metadata"]["generateName"].as_str().unwrap_or("pod-")
            );
            pod["metadata"]["name"] = generated.into();
        }
        std::fs::create_dir_all(&dir).unwrap();
        let path = std::path::Path::new(&dir).join(name);
        std::fs::write(path, serde_json::to_string_pretty(&pod).unwrap()).unwrap();
    }
}

fn response(review: &Value) -> &Value {
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    assert_eq!(review["response"]["allowed"], true, "{review}");
    &review["response"]
}

fn warnings(review: &Value) -> Vec<String> {
    review["response"]
        .get("warnings")
        .map(|w| serde_json::from_value(w.clone()).unwrap())
        .unwrap_or_default()
}

fn names(containers: &[Container]) -> Vec<&str> {
    containers.iter().map(|c| c.name.as_str()).collect()
}

fn env(c: &Container) -> Vec<(String, String)> {
    c.env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

fn proxy_env() -> Vec<(String, String)> {
    vec![
        ("HTTP_PROXY".into(), PROXY_URL.into()),
        ("http_proxy".into(), PROXY_URL.into()),
        ("NO_PROXY".into(), DEFAULT_NO_PROXY.into()),
    ]
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn annotations(pod: &Pod) -> BTreeMap<String, String> {
    pod.metadata.annotations.clone().unwrap_or_default()
}

/// What every injected sidecar has, whatever the mode.
fn assert_sidecar_basics(c: &Container, image: &str) {
    assert_eq!(c.name, "egress-sidecar");
    assert_eq!(c.image.as_deref(), Some(image));
    let startup = c.startup_probe.as_ref().expect("startupProbe");
    assert_eq!(
        startup.exec.as_ref().unwrap().command.as_ref().unwrap(),
        &["/usr/local/bin/egress-sidecar", "healthcheck"]
    );
    assert!(
        startup.http_get.is_none(),
        "httpGet cannot reach a loopback admin port"
    );
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let env = env(c);
    assert!(
        env.contains(&("EGRESS_LISTEN".into(), "127.0.0.1:15080".into())),
        "{env:?}"
    );
    assert!(
        env.contains(&("EGRESS_ADMIN".into(), "127.0.0.1:15081".into())),
        "{env:?}"
    );
}

fn quantity(c: &Container, kind: &str, what: &str) -> Option<String> {
    let r = c.resources.as_ref()?;
    let map = if kind == "limits" {
        r.limits.as_ref()
    } else {
        r.requests.as_ref()
    }?;
    map.get(what).map(|q| q.0.clone())
}

// === tests ===

#[tokio::test]
async fn plain_pod_gets_a_native_sidecar_and_proxy_env() {
    let hook = Webhook::start(settings()).await;
    let review = hook.review("plain-pod.json").await;
    let resp = response(&review);
    assert_eq!(resp["uid"], "7f0c2a1e-0001-4000-8000-00000000aa01");
    assert!(warnings(&review).is_empty(), "{review}");
    let (_, pod) = patched("plain-pod.json", &review);
    let spec = pod.spec.as_ref().unwrap();

    let init = spec.init_containers.as_deref().unwrap();
    assert_eq!(names(init), ["egress-sidecar"]);
    let sidecar = &init[0];
    assert_sidecar_basics(sidecar, IMAGE);
    assert_eq!(
        sidecar.restart_policy.as_deref(),
        Some("Always"),
        "native sidecar"
    );
    assert_eq!(quantity(sidecar, "requests", "cpu").as_deref(), Some("50m"));
    assert_eq!(quantity(sidecar, "requests", "memory").as_deref(), Some("32Mi"));
    assert_eq!(quantity(sidecar, "limits", "memory").as_deref(), Some("128Mi"));
    assert!(sidecar.volume_mounts.is_none(), "no ConfigMap asked for");

    assert_eq!(names(&spec.containers), ["app"]);
    assert_eq!(env(&spec.containers[0]), proxy_env());
    // The rest of the pod is untouched.
    assert_eq!(spec.containers[0].ports.as_ref().unwrap()[0].container_port, 8080);
    assert!(spec.volumes.is_none());
    assert_eq!(
        annotations(&pod),
        BTreeMap::from([("egress-sidecar.io/status".to_string(), "injected".to_string())])
    );
    hook.stop().await;
}

#[tokio::test]
async fn pod_with_init_containers_volumes_and_annotations() {
    let hook = Webhook::start(settings()).await;
    let review = hook.review("init-containers.json").await;
    assert!(warnings(&review).is_empty(), "{review}");
    let (_, pod) = patched("init-containers.json", &review);
    let spec = pod.spec.as_ref().unwrap();

    // First, so that later init containers can use the proxy; the user's init container stays.
    let init = spec.init_containers.as_deref().unwrap();
    assert_eq!(names(init), ["egress-sidecar", "migrate"]);
    let sidecar = &init[0];
    // Per-pod annotations: image, memory limit, ConfigMap, TLS hosts.
    assert_sidecar_basics(sidecar, "registry.example/egress-sidecar:0.1.0");
    assert_eq!(quantity(sidecar, "limits", "memory").as_deref(), Some("96Mi"));
    assert_eq!(quantity(sidecar, "requests", "memory").as_deref(), Some("32Mi"));
    let sidecar_env = env(sidecar);
    assert!(sidecar_env.contains(&("EGRESS_TLS_HOSTS".into(), "api.openai.com,api.stripe.com".into())));
    assert!(sidecar_env.contains(&("EGRESS_CONFIG".into(), "/etc/egress-sidecar/config.yaml".into())));
    let mounts = sidecar.volume_mounts.as_ref().unwrap();
    assert_eq!(mounts.len(), 1);
    assert_eq!(mounts[0].name, "egress-sidecar-config");
    assert_eq!(mounts[0].mount_path, "/etc/egress-sidecar");
    assert_eq!(mounts[0].read_only, Some(true));

    let volumes = spec.volumes.as_deref().unwrap();
    assert_eq!(
        volumes.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(),
        ["data", "egress-sidecar-config"]
    );
    assert_eq!(volumes[1].config_map.as_ref().unwrap().name, "checkout-egress");

    // The user's env comes first and is unchanged.
    assert_eq!(names(&spec.containers), ["app"]);
    let mut expected = pairs(&[("LOG_LEVEL", "info")]);
    expected.extend(proxy_env());
    assert_eq!(env(&spec.containers[0]), expected);
    // Init containers other than ours get no env.
    assert!(init[1].env.is_none());

    let ann = annotations(&pod);
    assert_eq!(ann["egress-sidecar.io/status"], "injected");
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann.len(), 6, "{ann:?}");
    hook.stop().await;
}

#[tokio::test]
async fn user_proxy_env_is_never_overwritten() {
    let hook = Webhook::start(settings()).await;
    let review = hook.review("sets-http-proxy.json").await;
    let (_, pod) = patched("sets-http-proxy.json", &review);
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(
        names(spec.init_containers.as_deref().unwrap()),
        ["egress-sidecar"]
    );
    assert_eq!(names(&spec.containers), ["app", "worker", "fetcher"]);
    // app chose its own proxy: it keeps it, and gets no lowercase twin pointing elsewhere.
    assert_eq!(
        env(&spec.containers[0]),
        pairs(&[
            ("HTTP_PROXY", "http://proxy.corp.example:3128"),
            ("NO_PROXY", DEFAULT_NO_PROXY)
        ])
    );
    // worker set no_proxy: it keeps it and gets the proxy.
    assert_eq!(
        env(&spec.containers[1]),
        pairs(&[
            ("no_proxy", "internal.example"),
            ("QUEUE", "orders"),
            ("HTTP_PROXY", PROXY_URL),
            ("http_proxy", PROXY_URL)
        ])
    );
    // fetcher set http_proxy (curl reads only the lowercase one) and NO_PROXY: both settings are
    // its own, so nothing is added.
    assert_eq!(
        env(&spec.containers[2]),
        pairs(&[
            ("http_proxy", "http://proxy.corp.example:3128"),
            ("NO_PROXY", "10.0.0.0/8")
        ])
    );
    hook.stop().await;
}

#[tokio::test]
async fn already_injected_pod_is_left_alone() {
    let hook = Webhook::start(settings()).await;
    let review = hook.review("already-injected.json").await;
    let resp = response(&review);
    assert_eq!(resp["uid"], "7f0c2a1e-0004-4000-8000-00000000aa04");
    assert!(resp.get("patch").is_none(), "{review}");
    assert!(resp.get("patchType").is_none(), "{review}");
    assert!(warnings(&review).is_empty());

    // And injection is idempotent: review the pod we patched once more, get nothing.
    for fixture in ["plain-pod.json", "init-containers.json", "classic.json"] {
        let (once, _) = patched(fixture, &hook.review(fixture).await);
        let mut again: Value = serde_json::from_str(&read_fixture(fixture)).unwrap();
        again["request"]["object"] = once;
        let reply = hook.post(again.to_string()).await;
        let review: Value = serde_json::from_str(&reply.body).unwrap();
        assert!(
            response(&review).get("patch").is_none(),
            "{fixture} reviewed twice: {review}"
        );
    }

    // Reinvoked after a later webhook appended a container: that container gets the proxy env,
    // and no second sidecar is added.
    let (mut pod, _) = patched("plain-pod.json", &hook.review("plain-pod.json").await);
    let late = serde_json::json!({"name": "late", "image": "registry.example/agent:1"});
    pod["spec"]["containers"].as_array_mut().unwrap().push(late);
    let mut again: Value = serde_json::from_str(&read_fixture("plain-pod.json")).unwrap();
    again["request"]["object"] = pod.clone();
    let review: Value = serde_json::from_str(&hook.post(again.to_string()).await.body).unwrap();
    let patch = patch_of(&review).expect("env for the new container");
    json_patch::patch(&mut pod, &patch).unwrap();
    let pod: Pod = serde_json::from_value(pod).unwrap();
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(
        names(spec.init_containers.as_deref().unwrap()),
        ["egress-sidecar"]
    );
    assert_eq!(names(&spec.containers), ["app", "late"]);
    assert_eq!(env(&spec.containers[0]), proxy_env());
    assert_eq!(env(&spec.containers[1]), proxy_env());
    hook.stop().await;
}

#[tokio::test]
async fn pod_without_the_label_is_left_alone() {
    let hook = Webhook::start(settings()).await;
    let review = hook.review("no-label.json").await;
    let resp = response(&review);
    assert_eq!(resp["uid"], "7f0c2a1e-0005-4000-8000-00000000aa05");
    assert!(resp.get("patch").is_none(), "{review}");
    assert!(warnings(&review).is_empty());

    // A label value other than "true" is not an opt-in either.
    let mut review_in: Value = serde_json::from_str(&read_fixture("plain-pod.json")).unwrap();
    review_in["request"]["object"]["metadata"]["labels"]["egress-sidecar.io/inject"] = "false".into();
    let reply = hook.post(review_in.to_string()).await;
    let review: Value = serde_json::from_str(&reply.body).unwrap();
    assert!(response(&review).get("patch").is_none(), "{review}");
    hook.stop().await;
}

#[tokio::test]
async fn classic_form_when_the_pod_asks() {
    let hook = Webhook::start(settings()).await;
    let review = hook.review("classic.json").await;
    let (_, pod) = patched("classic.json", &review);
    let spec = pod.spec.as_ref().unwrap();
    assert!(spec.init_containers.is_none());
    assert_eq!(names(&spec.containers), ["egress-sidecar", "app", "metrics"]);
    let sidecar = &spec.containers[0];
    assert_sidecar_basics(sidecar, IMAGE);
    assert_eq!(
        sidecar.restart_policy, None,
        "restartPolicy on a container is native-only"
    );
    // Env went to the app containers even though the sidecar shifted their indices.
    assert_eq!(env(&spec.containers[1]), proxy_env());
    let mut metrics = pairs(&[("PORT", "9100")]);
    metrics.extend(proxy_env());
    assert_eq!(env(&spec.containers[2]), metrics);
    assert!(!env(sidecar).iter().any(|(k, _)| k == "HTTP_PROXY"));
    let ann = annotations(&pod);
    assert_eq!(ann["kubectl.kubernetes.io/default-container"], "app");
    assert_eq!(ann["egress-sidecar.io/status"], "injected");

    // The webhook-wide default works the same way.
    let hook2 = Webhook::start(Settings {
        mode: Mode::Classic,
        ..settings()
    })
    .await;
    let (_, pod) = patched("plain-pod.json", &hook2.review("plain-pod.json").await);
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(names(&spec.containers), ["egress-sidecar", "app"]);
    assert!(spec.init_containers.is_none());
    hook.stop().await;
    hook2.stop().await;
}

#[tokio::test]
async fn env_from_containers_get_no_env_and_a_warning() {
    let hook = Webhook::start(settings()).await;
    let review = hook.review("env-from.json").await;
    let w = warnings(&review);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("\"app\" uses envFrom"), "{w:?}");
    let (_, pod) = patched("env-from.json", &review);
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(
        names(spec.init_containers.as_deref().unwrap()),
        ["egress-sidecar"]
    );
    assert!(spec.containers[0].env.is_none());
    hook.stop().await;
}

#[tokio::test]
async fn bad_annotations_are_ignored_with_a_warning() {
    let hook = Webhook::start(settings()).await;
    let mut review_in: Value = serde_json::from_str(&read_fixture("plain-pod.json")).unwrap();
    review_in["request"]["object"]["metadata"]["annotations"] = serde_json::json!({
        "egress-sidecar.io/memory-limit": "lots",
        "egress-sidecar.io/mode": "sideways",
        "egress-sidecar.io/config-map": "Not_A_Name",
        "egress-sidecar.io/tls-hosts": "api.example.com,bad host",
    });
    let reply = hook.post(review_in.to_string()).await;
    let review: Value = serde_json::from_str(&reply.body).unwrap();
    let w = warnings(&review);
    assert_eq!(w.len(), 4, "{w:?}");
    for key in ["memory-limit", "mode", "config-map", "tls-hosts"] {
        assert!(
            w.iter()
                .any(|w| w.contains(&format!("egress-sidecar.io/{key} ignored"))),
            "{key}: {w:?}"
        );
    }
    // The defaults apply instead.
    let mut pod = review_in["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch_of(&review).unwrap()).unwrap();
    let pod: Pod = serde_json::from_value(pod).unwrap();
    let sidecar = &pod.spec.as_ref().unwrap().init_containers.as_ref().unwrap()[0];
    assert_eq!(quantity(sidecar, "limits", "memory").as_deref(), Some("128Mi"));
    assert!(sidecar.volume_mounts.is_none());
    assert!(!env(sidecar).iter().any(|(k, _)| k == "EGRESS_TLS_HOSTS"));
    hook.stop().await;
}

#[tokio::test]
async fn malformed_reviews_are_allowed_unchanged_with_a_warning() {
    let hook = Webhook::start(settings()).await;
    let cases: Vec<(&str, String, &str)> = vec![
        ("empty body", String::new(), ""),
        ("not JSON", "{\"apiVersion\": ".into(), ""),
        ("a JSON array", "[1, 2, 3]".into(), ""),
        (
            "no request",
            r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.into(),
            "",
        ),
        (
            "v1beta1",
            r#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"u-1"}}"#
                .into(),
            "u-1",
        ),
        (
            "containers is a string",
            {
                let mut v: Value = serde_json::from_str(&read_fixture("plain-pod.json")).unwrap();
                v["request"]["object"]["spec"]["containers"] = "app".into();
                v.to_string()
            },
            "7f0c2a1e-0001-4000-8000-00000000aa01",
        ),
        (
            "label value is a number",
            {
                let mut v: Value = serde_json::from_str(&read_fixture("plain-pod.json")).unwrap();
                v["request"]["object"]["metadata"]["labels"]["egress-sidecar.io/inject"] = 1.into();
                v.to_string()
            },
            "7f0c2a1e-0001-4000-8000-00000000aa01",
        ),
        (
            "no object",
            r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u-2","operation":"CREATE"}}"#
                .into(),
            "u-2",
        ),
    ];
    for (what, body, uid) in cases {
        let reply = hook.post(body).await;
        assert_eq!(reply.status, 200, "{what}: {}", reply.body);
        let review: Value =
            serde_json::from_str(&reply.body).unwrap_or_else(|e| panic!("{what}: {e}: {}", reply.body));
        let resp = response(&review);
        assert_eq!(resp["uid"], uid, "{what}");
        assert!(resp.get("patch").is_none(), "{what}: {review}");
        let w = warnings(&review);
        assert_eq!(w.len(), 1, "{what}: {w:?}");
        assert!(
            w[0].starts_with("egress-sidecar injector: pod not changed: "),
            "{what}: {w:?}"
        );
    }
    // Other resources and operations pass without a word.
    let mut v: Value = serde_json::from_str(&read_fixture("plain-pod.json")).unwrap();
    v["request"]["operation"] = "UPDATE".into();
    let review: Value = serde_json::from_str(&hook.post(v.to_string()).await.body).unwrap();
    assert!(response(&review).get("patch").is_none());
    assert!(warnings(&review).is_empty());
    // The server is still there.
    assert!(patch_of(&hook.review("plain-pod.json").await).is_some());
    hook.stop().await;
}

#[tokio::test]
async fn wrong_method_path_and_size_get_http_errors() {
    let hook = Webhook::start(settings()).await;
    let ca = hook.ca.pem.clone();
    let get = request(hook.addr, &ca, "GET", "/inject", Bytes::new()).await;
    assert_eq!(get.status, 405);
    assert_eq!(get.allow.as_deref(), Some("POST"));
    let put = request(hook.addr, &ca, "PUT", "/inject", Bytes::from("{}")).await;
    assert_eq!(put.status, 405);
    let missing = request(hook.addr, &ca, "POST", "/mutate", Bytes::from("{}")).await;
    assert_eq!(missing.status, 404);
    let health = request(hook.addr, &ca, "GET", "/healthz", Bytes::new()).await;
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"));
    let post_health = request(hook.addr, &ca, "POST", "/healthz", Bytes::new()).await;
    assert_eq!(
        (post_health.status, post_health.allow.as_deref()),
        (405, Some("GET"))
    );
    let huge = raw_head(
        hook.addr,
        &ca,
        "POST /inject HTTP/1.1\r\nHost: x\r\nContent-Length: 9437184\r\n\r\n",
    )
    .await;
    assert!(huge.starts_with("HTTP/1.1 413 "), "{huge}");
    // Plain HTTP on the TLS port gets no answer, and the server carries on.
    let mut plain = tokio::net::TcpStream::connect(hook.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut plain, b"POST /inject HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(support::closes_within(&mut plain, Duration::from_secs(5)).await);
    assert_eq!(hook.post(read_fixture("plain-pod.json")).await.status, 200);
    hook.stop().await;
}

#[tokio::test]
async fn a_renewed_certificate_is_picked_up_without_a_restart() {
    let hook = Webhook::start(settings()).await;
    let (_, before) = connect(hook.addr, &hook.ca.pem).await.unwrap();
    // cert-manager writes a new pair into the same files.
    let dir = TempDir::new();
    let renewed = hook.ca.write_leaf(&dir, WEBHOOK_NAME);
    let first_mtime = std::fs::metadata(&hook.files.cert).unwrap().modified().unwrap();
    std::fs::copy(&renewed.key, &hook.files.key).unwrap();
    std::fs::copy(&renewed.cert, &hook.files.cert).unwrap();
    // A later mtime than the first pair's, even on a coarse-grained clock: the watcher looks
    // for a changed mtime.
    for path in [&hook.files.key, &hook.files.cert] {
        let file = std::fs::File::options().write(true).open(path).unwrap();
        file.set_modified(first_mtime + Duration::from_secs(1)).unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, leaf) = connect(hook.addr, &hook.ca.pem).await.unwrap();
        if leaf != before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the renewed certificate was not served within 5s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A broken pair (say, mid-rotation) keeps the last good one in service.
    std::fs::write(&hook.files.cert, "not a certificate").unwrap();
    let file = std::fs::File::options()
        .write(true)
        .open(&hook.files.cert)
        .unwrap();
    file.set_modified(first_mtime + Duration::from_secs(2)).unwrap();
    // Not synchronisation: a window of four of the watcher's 50 ms polls in which the broken
    // pair must not replace the good one (nothing observable happens when it is kept).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(hook.post(read_fixture("plain-pod.json")).await.status, 200);
    hook.stop().await;
}

#[tokio::test]
async fn the_binary_serves_the_webhook() {
    use tokio::io::AsyncBufReadExt;
    let dir = TempDir::new();
    let ca = Ca::new("binary test CA");
    let files = ca.write_leaf(&dir, WEBHOOK_NAME);
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_egress-sidecar"))
        .args(["inject", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&files.cert)
        .arg("--tls-key")
        .arg(&files.key)
        .args(["--image", IMAGE, "--shutdown-linger", "0s"])
        .env("EGRESS_LOG_FORMAT", "json")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr: SocketAddr = loop {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("the webhook starts within 20s")
            .unwrap()
            .expect("the webhook exited before listening");
        if line.contains("injection webhook listening") {
            let v: Value = serde_json::from_str(&line).unwrap();
            break v["fields"]["listen"].as_str().unwrap().parse().unwrap();
        }
    };
    let reply = request(
        addr,
        &ca.pem,
        "POST",
        "/inject",
        read_fixture("plain-pod.json").into(),
    )
    .await;
    assert_eq!(reply.status, 200);
    let review: Value = serde_json::from_str(&reply.body).unwrap();
    let (_, pod) = patched("plain-pod.json", &review);
    assert_eq!(
        pod.spec.unwrap().init_containers.unwrap()[0].image.as_deref(),
        Some(IMAGE)
    );
    // The review is logged with the pod and what was done.
    let logged = loop {
        let line = tokio::time::timeout(Duration::from_secs(5), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if line.contains("admission review") {
            break line;
        }
    };
    assert!(logged.contains("shop/checkout-7d9f8b6c5-*"), "{logged}");
    assert!(logged.contains("injected (native)"), "{logged}");

    // SIGTERM: with no linger it exits 0 promptly.
    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits within 10s of SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn the_binary_refuses_bad_settings_and_files() {
    let dir = TempDir::new();
    let ca = Ca::new("binary test CA");
    let files = ca.write_leaf(&dir, WEBHOOK_NAME);
    let run = |extra: &[&str], cert: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_egress-sidecar"))
            .args(["inject", "--listen", "127.0.0.1:0", "--tls-cert"])
            .arg(cert)
            .arg("--tls-key")
            .arg(&files.key)
            .args(extra)
            .output()
            .unwrap()
    };
    let bad_limit = run(&["--memory-limit", "lots"], &files.cert);
    assert_eq!(bad_limit.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_limit.stderr).contains("--memory-limit"));
    let bad_mode = run(&["--mode", "sideways"], &files.cert);
    assert_eq!(bad_mode.status.code(), Some(2));
    let missing = run(&[], &dir.path.join("nope.crt"));
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("nope.crt"));
}
