//! The fingerprint of a request and the scope of a record, both SHA-256: stable across
//! builds and machines, so instances sharing a store agree.

use http::request::Parts;
use sha2::{Digest, Sha256};

use super::record::Fingerprint;

/// SHA-256 over the method, path, query and body, each prefixed by its length as a
/// big-endian `u64` (so no two requests share an input).
pub(crate) fn fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let mut hasher = Sha256::new();
    for part in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or("").as_bytes(),
        body,
    ] {
        push_part(&mut hasher, part);
    }
    hasher.finalize().into()
}

/// The scope of a record, in lowercase hex: SHA-256 over the method, the route (axum's
/// matched route when there is one, else the path), the request's path and query, and
/// the principal, if any. The path and query are in it whatever the fingerprint
/// setting, so a key reused on another resource never replays this one's response.
pub(crate) fn scope(parts: &Parts, principal: Option<&str>) -> Scope {
    let mut hasher = Sha256::new();
    push_part(&mut hasher, parts.method.as_str().as_bytes());
    push_part(&mut hasher, route(parts).as_bytes());
    push_part(&mut hasher, parts.uri.path().as_bytes());
    push_part(&mut hasher, parts.uri.query().unwrap_or("").as_bytes());
    match principal {
        Some(principal) => {
            hasher.update([1]);
            push_part(&mut hasher, principal.as_bytes());
        }
        None => hasher.update([0]),
    }
    Scope::hex(&hasher.finalize().into())
}

#[cfg(feature = "axum")]
fn route(parts: &Parts) -> &str {
    parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or(parts.uri.path(), axum::extract::MatchedPath::as_str)
}

#[cfg(not(feature = "axum"))]
fn route(parts: &Parts) -> &str {
    parts.uri.path()
}

fn push_part(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

/// A record's scope: a SHA-256 digest in 64 lowercase hex digits, kept inline so that
/// naming a request's record allocates nothing.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Scope([u8; 64]);

impl Scope {
    fn hex(digest: &[u8; 32]) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0; 64];
        for (pair, &byte) in out.chunks_exact_mut(2).zip(digest) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 0xf)];
        }
        Self(out)
    }

    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(method: &str, uri: &str) -> Parts {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn fingerprint_covers_method_path_query_and_body() {
        let base = fingerprint(&parts("POST", "/a?x=1"), b"body");
        assert_eq!(base, fingerprint(&parts("POST", "/a?x=1"), b"body"));
        for other in [
            fingerprint(&parts("PUT", "/a?x=1"), b"body"),
            fingerprint(&parts("POST", "/b?x=1"), b"body"),
            fingerprint(&parts("POST", "/a?x=2"), b"body"),
            fingerprint(&parts("POST", "/a?x=1"), b"bodY"),
            // Moving bytes between parts changes it too.
            fingerprint(&parts("POST", "/a?x=1b"), b"ody"),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn scope_separates_methods_routes_and_principals() {
        let post = parts("POST", "/a");
        let scopes = [
            scope(&post, None),
            scope(&parts("PUT", "/a"), None),
            scope(&parts("POST", "/b"), None),
            scope(&post, Some("alice")),
            scope(&post, Some("bob")),
            scope(&post, Some("")),
        ];
        let unique: std::collections::HashSet<_> = scopes.iter().collect();
        assert_eq!(unique.len(), scopes.len());
        assert_eq!(scopes[0].as_str().len(), 64);
    }

    /// Instances sharing a store must name a record alike, whatever their build: the
    /// scope is SHA-256 over the length-prefixed method, route, path and query, then
    /// the principal, in lowercase hex (values from Python's `hashlib`).
    #[test]
    fn scope_is_the_documented_digest() {
        let request = parts("POST", "/a?x=1");
        assert_eq!(
            scope(&request, None).as_str(),
            "a7bf71eb486aa520cc4342f5ed2d4da4d823eef1ec0d177d3021ce53c99b10a1"
        );
        assert_eq!(
            scope(&request, Some("alice")).as_str(),
            "e5d8f89b62697ae02e90c763bd1abb8475c8e54a2b13c811a36a39fe7467f869"
        );
    }

    #[test]
    fn scope_covers_the_path_and_query() {
        let scopes = [
            scope(&parts("POST", "/a?x=1"), None),
            scope(&parts("POST", "/a?x=2"), None),
            scope(&parts("POST", "/a"), None),
            scope(&parts("POST", "/a?"), None),
            scope(&parts("POST", "/ax=1"), None),
        ];
        let unique: std::collections::HashSet<_> = scopes.iter().collect();
        // `/a` and `/a?` differ only by an empty query: the same resource.
        assert_eq!(unique.len(), scopes.len() - 1);
        assert_eq!(scopes[2], scopes[3]);
    }
}
