//! Headers an upstream's requests get on the way out (`request_headers`): set, replacing what
//! the application sent, from a literal or from a file kept current (an API key in a mounted
//! Secret, rotated without a restart), or removed. Values are marked sensitive: no log line
//! and no HPACK table holds them.

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::config::{header_file_value, HeaderRules, HeaderSource};
use crate::watched::Watched;

/// An upstream's header rules, ready to apply.
#[derive(Debug)]
pub(super) struct Rules {
    set: Vec<(HeaderName, Value)>,
    remove: Vec<HeaderName>,
}

#[derive(Debug)]
enum Value {
    Literal(HeaderValue),
    File(Watched<HeaderValue>),
}

impl Rules {
    /// The rules `config` describes; `None` when there are none (nothing to do per request).
    pub(super) fn new(config: &HeaderRules) -> Option<Self> {
        if config.is_empty() {
            return None;
        }
        let set = config
            .set
            .iter()
            .map(|(name, source)| {
                let value = match source {
                    HeaderSource::Literal(value) => Value::Literal(value.clone()),
                    HeaderSource::File(path) => Value::File(Watched::new(vec![path.clone()], file_value)),
                };
                (name.clone(), value)
            })
            .collect();
        Some(Rules {
            set,
            remove: config.remove.clone(),
        })
    }

    /// The names the rules set.
    pub(super) fn set_names(&self) -> impl Iterator<Item = &HeaderName> {
        self.set.iter().map(|(name, _)| name)
    }

    /// Applies the rules to a request's headers: removals first, then each set value replaces
    /// every value the application sent under its name.
    pub(super) fn apply(&self, headers: &mut HeaderMap) {
        for name in &self.remove {
            headers.remove(name);
        }
        for (name, value) in &self.set {
            let value = match value {
                Value::Literal(value) => Some(value.clone()),
                Value::File(file) => file.get(),
            };
            match value {
                Some(value) => {
                    headers.insert(name.clone(), value);
                }
                // A file never read (gone since `check`): the app's value must not pass
                // either, or it would go out under the operator's name.
                None => {
                    headers.remove(name);
                }
            }
        }
    }
}

fn file_value(contents: &[Vec<u8>]) -> Result<HeaderValue, String> {
    header_file_value(&contents[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn set_replaces_every_value_and_files_follow_their_content() {
        let dir = std::env::temp_dir().join(format!("egress-rules-apply-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        std::fs::write(&key, "Bearer one\n").unwrap();
        let config = HeaderRules {
            set: vec![
                (http::header::AUTHORIZATION, HeaderSource::File(key.clone())),
                (
                    HeaderName::from_static("x-team"),
                    HeaderSource::Literal("blue".parse().unwrap()),
                ),
            ],
            remove: vec![HeaderName::from_static("x-debug")],
        };
        let rules = Rules::new(&config).unwrap();
        let mut headers = HeaderMap::new();
        headers.append(http::header::AUTHORIZATION, "Bearer app".parse().unwrap());
        headers.append(http::header::AUTHORIZATION, "Bearer app2".parse().unwrap());
        headers.insert("x-debug", "1".parse().unwrap());
        rules.apply(&mut headers);
        let auth: Vec<_> = headers.get_all(http::header::AUTHORIZATION).iter().collect();
        assert_eq!(auth, ["Bearer one"], "exactly one, the file's");
        assert!(auth[0].is_sensitive());
        assert_eq!(headers["x-team"], "blue");
        assert!(!headers.contains_key("x-debug"));

        std::fs::write(&key, "Bearer two\n").unwrap();
        tokio::time::advance(crate::watched::RECHECK).await;
        rules.apply(&mut headers);
        assert_eq!(headers[http::header::AUTHORIZATION], "Bearer two");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(Rules::new(&HeaderRules::default()).is_none());
    }

    /// Through `Spec::dynamic`, what an upstream met on the fly is built from: the test fails
    /// when the spec takes `defaults` whole (`settings: config.defaults.clone()`, or
    /// `tls: config.defaults.tls.clone()`), not only when `dynamic_settings` changes.
    #[test]
    fn defaults_set_values_never_go_to_hosts_met_on_the_fly() {
        let dir = std::env::temp_dir().join(format!("egress-rules-dynamic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["client.test".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (crt, key_file, ca) = (dir.join("c.pem"), dir.join("k.pem"), dir.join("ca.pem"));
        std::fs::write(&crt, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        std::fs::write(&ca, cert.pem()).unwrap();
        let config = crate::config::parse(
            &format!(
                "defaults:\n  request_headers: {{ set: {{ Authorization: \"Bearer d\" }}, remove: [X-Debug] }}\n  \
                 tls: {{ client_cert_file: {}, client_key_file: {}, ca_file: {} }}\n",
                crt.display(),
                key_file.display(),
                ca.display()
            ),
            &crate::config::Overrides::default(),
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let authority = crate::config::Authority::parse("anyhost.test:443", 443).unwrap();
        let spec = super::super::Spec::dynamic(crate::config::Scheme::Https, authority, &config);
        assert!(
            spec.settings.request_headers.set.is_empty(),
            "no credential for any host"
        );
        assert_eq!(
            spec.settings.request_headers.remove,
            [HeaderName::from_static("x-debug")]
        );
        for tls in [&spec.settings.tls, &spec.pool_key().tls.unwrap()] {
            assert_eq!(
                (&tls.client_cert_file, &tls.client_key_file),
                (&None, &None),
                "no client certificate"
            );
            assert_eq!(tls.ca_file.as_ref(), Some(&ca), "its trust stays");
        }
        assert_eq!(
            config.defaults.request_headers.set.len(),
            1,
            "configured upstreams keep it"
        );
        assert!(
            config.defaults.tls.client_cert_file.is_some(),
            "configured upstreams keep it"
        );
    }
}
