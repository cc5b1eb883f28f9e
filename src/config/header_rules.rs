//! The `request_headers` keys: headers the sidecar sets (a literal, or a file's content such as
//! an API key from a mounted Secret) or removes on the way upstream, typed and validated.

use std::path::PathBuf;

use http::{HeaderName, HeaderValue};
use serde::Serialize;

use super::problems::Problems;
use super::schema::{FileHeaderRules, FileHeaderValue, Scalar};

/// Header rules of one upstream (its own merged over `defaults`').
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderRules {
    /// Set, replacing what the application sent, in name order.
    pub set: Vec<(HeaderName, HeaderSource)>,
    /// Removed.
    pub remove: Vec<HeaderName>,
}

impl Serialize for HeaderRules {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let set: std::collections::BTreeMap<&str, &HeaderSource> =
            self.set.iter().map(|(n, v)| (n.as_str(), v)).collect();
        let remove: Vec<&str> = self.remove.iter().map(HeaderName::as_str).collect();
        let mut map = s.serialize_map(Some(2))?;
        map.serialize_entry("set", &set)?;
        map.serialize_entry("remove", &remove)?;
        map.end()
    }
}

impl Serialize for HeaderSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self {
            // The effective config `check` prints never shows a value.
            HeaderSource::Literal(_) => s.serialize_str("<hidden>"),
            HeaderSource::File(path) => {
                let mut map = s.serialize_map(Some(1))?;
                map.serialize_entry("file", path)?;
                map.end()
            }
        }
    }
}

/// Where a set header's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderSource {
    /// A value written in the config (marked sensitive: never logged).
    Literal(HeaderValue),
    /// A file's content, trimmed, re-read when it changes.
    File(PathBuf),
}

impl HeaderRules {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.remove.is_empty()
    }
}

/// Headers the sidecar frames or routes by itself: rules may not touch them.
const MANAGED: [&str; 9] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "upgrade",
    "proxy-connection",
    "proxy-authorization",
];

/// A header file's content as a header value: trimmed (a trailing newline is not part of a key),
/// marked sensitive.
pub fn header_file_value(contents: &[u8]) -> Result<HeaderValue, String> {
    let text = String::from_utf8_lossy(contents);
    let text = text.trim();
    if text.is_empty() {
        return Err("is empty".into());
    }
    let mut value =
        HeaderValue::from_str(text).map_err(|_| "holds characters a header value cannot carry".to_owned())?;
    value.set_sensitive(true);
    Ok(value)
}

/// `request_headers` under `prefix`, merged over `base`: set by name (this one wins), remove
/// added to the base's.
pub(super) fn merge_header_rules(
    base: &HeaderRules,
    raw: &Option<FileHeaderRules>,
    prefix: &str,
    problems: &mut Problems,
) -> HeaderRules {
    let Some(raw) = raw else {
        return base.clone();
    };
    let mut rules = base.clone();
    for (name_text, value) in raw.set.iter().flatten() {
        let key = format!("{prefix}.set.{name_text}");
        let Some(name) = header_name(name_text, &key, problems) else {
            continue;
        };
        let source = match value {
            FileHeaderValue::Literal(scalar) => {
                let text = match scalar {
                    Scalar::Int(n) => n.to_string(),
                    Scalar::Str(s) => s.clone(),
                };
                match HeaderValue::from_str(&text) {
                    Ok(mut value) => {
                        value.set_sensitive(true);
                        HeaderSource::Literal(value)
                    }
                    Err(_) => {
                        problems.add(key, "holds characters a header value cannot carry");
                        continue;
                    }
                }
            }
            FileHeaderValue::File(file) => {
                let checked = std::fs::read(&file.file)
                    .map_err(|e| e.to_string())
                    .and_then(|bytes| header_file_value(&bytes).map(|_| ()));
                if let Err(why) = checked {
                    problems.add(key, format!("{}: {why}", file.file.display()));
                }
                HeaderSource::File(file.file.clone())
            }
        };
        rules.set.retain(|(n, _)| *n != name);
        rules.set.push((name, source));
    }
    rules.set.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    for (i, name_text) in raw.remove.iter().flatten().enumerate() {
        if let Some(name) = header_name(name_text, &format!("{prefix}.remove[{i}]"), problems) {
            if !rules.remove.contains(&name) {
                rules.remove.push(name);
            }
        }
    }
    rules
}

fn header_name(text: &str, key: &str, problems: &mut Problems) -> Option<HeaderName> {
    let Ok(name) = HeaderName::from_bytes(text.trim().as_bytes()) else {
        problems.add(key, format!("{text:?} is not a header name"));
        return None;
    };
    if MANAGED.contains(&name.as_str()) {
        problems.add(
            key,
            format!("{name} is the sidecar's to write (framing, routing or hop-by-hop)"),
        );
        return None;
    }
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::super::{parse, Overrides};

    #[test]
    fn rules_merge_over_the_defaults_and_name_bad_keys() {
        let dir = std::env::temp_dir().join(format!("egress-rules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        std::fs::write(&key, "sk-123\n").unwrap();
        let yaml = format!(
            "defaults:\n  request_headers: {{ set: {{ X-Team: blue, Authorization: \"Bearer d\" }}, remove: [X-Debug] }}\n\
             upstreams:\n  - url: http://a.example\n    request_headers: {{ set: {{ Authorization: {{ file: {} }} }}, remove: [Cookie] }}\n",
            key.display()
        );
        let config = parse(&yaml, &Overrides::default()).unwrap();
        let rules = &config.upstreams[0].settings.request_headers;
        let names: Vec<&str> = rules.set.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["authorization", "x-team"]);
        assert_eq!(rules.set[0].1, super::HeaderSource::File(key));
        let removed: Vec<&str> = rules.remove.iter().map(|n| n.as_str()).collect();
        assert_eq!(removed, ["x-debug", "cookie"]);
        let shown = super::super::to_yaml(&config);
        assert!(!shown.contains("Bearer d"), "{shown}");

        let keys: Vec<String> = super::super::problems(
            "upstreams:\n  - url: http://a.example\n    request_headers: { set: { Authorization: { file: /nonexistent/key }, Host: x } }\n",
        )
        .into_iter()
        .map(|(key, _)| key)
        .collect();
        assert_eq!(
            keys,
            [
                "upstreams[0].request_headers.set.Authorization",
                "upstreams[0].request_headers.set.Host"
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
