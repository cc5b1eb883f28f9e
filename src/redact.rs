//! Userinfo kept out of every output. A URL's `user:password@` is a credential: whatever shows an
//! authority or a request target that came from outside (access-log lines, log lines and span
//! fields, error bodies, metric labels) shows it through here, with the userinfo removed
//! (`http://alice:pw@host/x` is shown as `http://host/x`; nothing of the user or password is
//! kept, since a token often sits in the user part alone).
//!
//! In a parsed URI the authority ends where RFC 3986 ends it, at the first `/`, `?` or `#`, as
//! `http::Uri` reads it, and an `@` in its path is no userinfo; raw text is read more warily
//! ([`target`]).
//!
//! Not handled here: credential header fields (`wire::is_credential`, marked sensitive when
//! read) and the values `request_headers` sets (sensitive from the config on).

use std::borrow::Cow;
use std::fmt;

/// `authority` (`[userinfo@]host[:port]`, parsed or not) without its userinfo.
pub fn authority(authority: &str) -> &str {
    authority.rfind('@').map_or(authority, |at| &authority[at + 1..])
}

/// A target as it came on the wire (a request target in any form, a proxy URL), valid or not,
/// without userinfo: everything from the authority's start to the last `@` goes. Text that may
/// be invalid may carry a password with an unencoded `/` or `?`, so the last `@` anywhere
/// counts: what is shown may lose part of a path, never keep part of a password. Origin-form
/// (`/...`) has no authority and is shown whole.
pub fn target(target: &str) -> Cow<'_, str> {
    if target.starts_with('/') || target == "*" {
        return Cow::Borrowed(target);
    }
    let after_scheme = target.find("://").map_or(0, |at| at + 3);
    match target[after_scheme..].rfind('@') {
        None => Cow::Borrowed(target),
        Some(at) => {
            let mut shown = String::with_capacity(target.len());
            shown.push_str(&target[..after_scheme]);
            shown.push_str(&target[after_scheme + at + 1..]);
            Cow::Owned(shown)
        }
    }
}

/// `uri`, displayed as `Uri` displays itself, without userinfo.
pub fn uri(uri: &http::Uri) -> impl fmt::Display + '_ {
    WithoutUserinfo(uri)
}

struct WithoutUserinfo<'a>(&'a http::Uri);

impl fmt::Display for WithoutUserinfo<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let uri = self.0;
        if let Some(scheme) = uri.scheme() {
            write!(f, "{scheme}://")?;
        }
        if let Some(named) = uri.authority() {
            f.write_str(authority(named.as_str()))?;
        }
        f.write_str(uri.path())?;
        if let Some(query) = uri.query() {
            write!(f, "?{query}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_is_removed_and_nothing_else() {
        assert_eq!(authority("alice:s3cret@api.example:80"), "api.example:80");
        assert_eq!(authority("token@api.example"), "api.example");
        assert_eq!(authority("a@b@api.example"), "api.example");
        assert_eq!(authority("api.example:80"), "api.example:80");
        for (raw, shown) in [
            (
                "http://alice:s3cret@api.example/x?q=1",
                "http://api.example/x?q=1",
            ),
            ("http://alice@api.example", "http://api.example"),
            ("alice:s3cret@api.example:443", "api.example:443"),
            ("http://alice:p/w?x@api.example/", "http://api.example/"),
            ("http://api.example/users/@me", "http://me"),
            ("/users/@me?a@b", "/users/@me?a@b"),
            ("*", "*"),
            ("http://x:y@h:99999999/", "http://h:99999999/"),
        ] {
            assert_eq!(target(raw), shown, "{raw}");
        }
        for (raw, shown) in [
            (
                "http://alice:s3cret@api.example/x?q=1",
                "http://api.example/x?q=1",
            ),
            ("http://api.example/users/@me", "http://api.example/users/@me"),
            ("/v1/x?y=@", "/v1/x?y=@"),
        ] {
            let parsed: http::Uri = raw.parse().unwrap();
            assert_eq!(uri(&parsed).to_string(), shown, "{raw}");
        }
        let connect: http::Uri = "alice:pw@api.example:443".parse().unwrap();
        assert_eq!(uri(&connect).to_string(), "api.example:443");
    }
}
