//! Reaching upstreams through a parent proxy: its credentials (`Proxy-Authorization`, re-read
//! when the credentials file changes, never logged), the CONNECT that opens a tunnel through
//! it, and the `parent_refused` error.
//!
//! Plain HTTP/1.1 upstreams are reached with absolute-form requests on pooled connections to
//! the parent (`upstream` writes those); TLS upstreams, HTTP/2 and upgrades go through a
//! CONNECT tunnel, opened once per pooled connection.
//!
//! An `https://` parent is spoken to over TLS (what Squid's `https_port`, Chrome and curl call
//! a secure web proxy): the parent's name is verified against the system store plus
//! `via.ca_file`; a TLS upstream behind it is then TLS inside TLS.

use std::io;
use std::sync::Arc;

use base64::Engine as _;
use http::HeaderValue;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use tokio::net::TcpStream;

use super::h1::Transport;
use super::tls::TlsConnector;
use crate::config::{Authority, ParentRoute, ParentUrl, TlsConfig};
use crate::error::{ErrorKind, ProxyError};
use crate::watched::Watched;

/// The longest CONNECT answer head read from a parent.
const MAX_ANSWER_HEAD: usize = 16 * 1024;

/// A parent proxy and how to authenticate to it.
#[derive(Debug)]
pub struct Parent {
    url: ParentUrl,
    shown: Arc<str>,
    /// From the URL's userinfo (the proxy environment), when there is no file.
    inline: Option<HeaderValue>,
    /// The credentials file, kept current.
    file: Option<Watched<HeaderValue>>,
    /// TLS to an `https://` parent (`Err`: it cannot be set up, and every dial says why).
    tls: Option<Result<TlsConnector, String>>,
}

impl Parent {
    /// The parent `route` names, authenticating with its `credentials_file` (else the URL's
    /// userinfo).
    pub fn new(route: ParentRoute) -> Self {
        let ParentRoute {
            url,
            credentials_file,
            ca_file,
        } = route;
        let inline = url.userinfo.as_deref().and_then(basic);
        let shown: Arc<str> = url.display().into();
        let tls = (url.scheme == crate::config::Scheme::Https).then(|| {
            let settings = TlsConfig {
                ca_file,
                ..TlsConfig::default()
            };
            // The parent speaks HTTP/1.1 (CONNECT, absolute-form), whatever runs inside.
            TlsConnector::new(&settings, &url.authority.host, &[b"http/1.1"])
                .map_err(|why| format!("TLS to parent proxy {shown}: {why}"))
        });
        Parent {
            shown,
            url,
            inline,
            file: credentials_file.map(|path| Watched::new(vec![path], credentials)),
            tls,
        }
    }

    /// A connection to the parent over `tcp`: as it is for an `http://` parent, after a TLS
    /// handshake (by `deadline`) for an `https://` one.
    pub async fn secure(
        &self,
        tcp: TcpStream,
        label: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Transport, ProxyError> {
        let Some(tls) = &self.tls else {
            return Ok(Transport::Plain(tcp));
        };
        let error = |kind, cause: String| ProxyError::new(kind, cause).with_upstream(label);
        let tls = tls
            .as_ref()
            .map_err(|why| error(ErrorKind::TlsFailed, why.clone()))?;
        match tokio::time::timeout_at(deadline, tls.handshake(tcp)).await {
            Ok(Ok(stream)) => Ok(Transport::Tls(Box::new(stream))),
            Ok(Err(e)) => Err(error(
                ErrorKind::TlsFailed,
                format!("TLS handshake with parent proxy {}: {e}", self.shown),
            )),
            Err(_) => Err(error(
                ErrorKind::ConnectTimeout,
                format!(
                    "TLS handshake with parent proxy {} took longer than connect_timeout",
                    self.shown
                ),
            )),
        }
    }

    /// The parent's URL, without credentials.
    pub fn shown(&self) -> &Arc<str> {
        &self.shown
    }

    /// The parent's host and port.
    pub fn authority(&self) -> &Authority {
        &self.url.authority
    }

    /// The `Proxy-Authorization` value for the next request or CONNECT: the credentials file
    /// (looked at once per [`RECHECK`](crate::watched::RECHECK), re-read when it changed),
    /// else the URL's.
    pub fn proxy_authorization(&self) -> Option<HeaderValue> {
        match &self.file {
            Some(file) => file.get(),
            None => self.inline.clone(),
        }
    }

    /// The parent refused with `status` (and its reason phrase) what was asked of it.
    pub fn refused(&self, label: &str, status: u16, reason: &str, what: &str) -> ProxyError {
        ProxyError::new(
            ErrorKind::ParentRefused,
            format!("parent proxy {} answered {status} {reason} to {what}", self.shown),
        )
        .with_upstream(label)
    }

    /// Opens a tunnel to `target` through the parent on `io` (a connection to the parent):
    /// CONNECT, then the parent's answer, which must be 2xx with nothing after its head.
    pub async fn tunnel<S>(&self, io: &mut S, target: &Authority, label: &str) -> Result<(), ProxyError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n").into_bytes();
        if let Some(auth) = self.proxy_authorization() {
            head.extend_from_slice(b"Proxy-Authorization: ");
            head.extend_from_slice(auth.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        let failed = |e: io::Error| {
            ProxyError::new(
                ErrorKind::ConnectFailed,
                format!("CONNECT {target} through parent proxy {}: {e}", self.shown),
            )
            .with_upstream(label)
        };
        io.write_all(&head).await.map_err(failed)?;
        let mut answer = Vec::with_capacity(512);
        let mut buf = [0u8; 512];
        // One byte past the head would be the tunnel's: a parent sends none before the upstream
        // does, and the upstream speaks after the client (TLS, HTTP), so read to the head only.
        while !answer.ends_with(b"\r\n\r\n") {
            if answer.len() >= MAX_ANSWER_HEAD {
                return Err(self.protocol_error(label, "a CONNECT answer head over 16 KiB"));
            }
            let n = io.read(&mut buf[..1]).await.map_err(failed)?;
            if n == 0 {
                return Err(failed(io::ErrorKind::UnexpectedEof.into()));
            }
            answer.push(buf[0]);
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut parsed = httparse::Response::new(&mut headers);
        match parsed.parse(&answer) {
            Ok(httparse::Status::Complete(_)) => {}
            _ => return Err(self.protocol_error(label, "a malformed answer to CONNECT")),
        }
        let status = parsed.code.unwrap_or(0);
        if (200..300).contains(&status) {
            return Ok(());
        }
        let reason = parsed.reason.unwrap_or("");
        Err(self.refused(label, status, reason, &format!("CONNECT {target}")))
    }

    /// [`Parent::tunnel`] by `deadline` (the dial's, which took `connect_timeout`); past it,
    /// `connect_timeout` naming the parent.
    pub async fn tunnel_by<S>(
        &self,
        io: &mut S,
        target: &Authority,
        label: &str,
        deadline: tokio::time::Instant,
        connect_timeout: std::time::Duration,
    ) -> Result<(), ProxyError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        match tokio::time::timeout_at(deadline, self.tunnel(io, target, label)).await {
            Ok(result) => result,
            Err(_) => Err(ProxyError::new(
                ErrorKind::ConnectTimeout,
                format!(
                    "CONNECT {target} through parent proxy {} took longer than connect_timeout ({})",
                    self.shown,
                    humantime::format_duration(connect_timeout)
                ),
            )
            .with_upstream(label)),
        }
    }

    fn protocol_error(&self, label: &str, what: &str) -> ProxyError {
        ProxyError::new(
            ErrorKind::ProtocolError,
            format!("parent proxy {} sent {what}", self.shown),
        )
        .with_upstream(label)
    }
}

/// A credentials file's one line `user:password`, as a `Proxy-Authorization` value.
fn credentials(contents: &[Vec<u8>]) -> Result<HeaderValue, String> {
    let text = String::from_utf8_lossy(&contents[0]);
    basic(text.trim()).ok_or_else(|| "not one line user:password".to_owned())
}

/// `Basic base64(user:password)`, marked sensitive so that no log or dump shows it.
fn basic(userinfo: &str) -> Option<HeaderValue> {
    if userinfo.is_empty() {
        return None;
    }
    let encoded = base64::engine::general_purpose::STANDARD.encode(userinfo.as_bytes());
    let mut value = HeaderValue::from_str(&format!("Basic {encoded}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(url: &str, credentials_file: Option<std::path::PathBuf>) -> ParentRoute {
        ParentRoute {
            url: ParentUrl::parse(url).unwrap(),
            credentials_file,
            ca_file: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn credentials_follow_the_file() {
        let recheck = || tokio::time::advance(crate::watched::RECHECK);
        let dir = std::env::temp_dir().join(format!("egress-parent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("parent");
        std::fs::write(&file, "alice:one\n").unwrap();
        let parent = Parent::new(route("http://127.0.0.1:3128", Some(file.clone())));
        let expect = |text: &str| format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(text));
        assert_eq!(
            parent.proxy_authorization().unwrap(),
            expect("alice:one").as_str()
        );
        std::fs::write(&file, "alice:twotwo\n").unwrap();
        assert_eq!(
            parent.proxy_authorization().unwrap(),
            expect("alice:one").as_str(),
            "looked at once per RECHECK"
        );
        recheck().await;
        assert_eq!(
            parent.proxy_authorization().unwrap(),
            expect("alice:twotwo").as_str()
        );
        assert!(parent.proxy_authorization().unwrap().is_sensitive());
        std::fs::remove_file(&file).unwrap();
        recheck().await;
        assert_eq!(
            parent.proxy_authorization().unwrap(),
            expect("alice:twotwo").as_str(),
            "a file gone keeps the last value"
        );
        let _ = std::fs::remove_dir_all(&dir);
        let inline = Parent::new(route("http://bob:pw@proxy:3128", None));
        assert_eq!(inline.proxy_authorization().unwrap(), expect("bob:pw").as_str());
    }

    #[tokio::test]
    async fn a_tunnel_reads_the_answer_head_and_no_further() {
        let parent = Parent::new(route("http://127.0.0.1:3128", None));
        let target = Authority::parse("api.example.com:443", 443).unwrap();
        let (mut ours, mut theirs) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move {
            let mut got = vec![0u8; 256];
            let n = theirs.read(&mut got).await.unwrap();
            theirs
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\nTLS")
                .await
                .unwrap();
            String::from_utf8_lossy(&got[..n]).into_owned()
        });
        parent.tunnel(&mut ours, &target, "t").await.unwrap();
        let mut rest = [0u8; 3];
        ours.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"TLS", "bytes after the head stay in the stream");
        let sent = server.await.unwrap();
        assert!(
            sent.starts_with("CONNECT api.example.com:443 HTTP/1.1\r\n"),
            "{sent}"
        );

        let (mut ours, mut theirs) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let mut got = vec![0u8; 256];
            let _ = theirs.read(&mut got).await;
            let _ = theirs
                .write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
                .await;
        });
        let err = parent.tunnel(&mut ours, &target, "t").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ParentRefused);
        assert!(err.to_string().contains("407"), "{err}");
        assert!(err.to_string().contains("http://127.0.0.1:3128"), "{err}");
    }
}
