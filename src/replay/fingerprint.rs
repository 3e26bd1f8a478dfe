//! The fingerprint of a request and the scope of a record, both SHA-256: stable across
//! builds and machines, so instances sharing a store agree. The scope's parts
//! themselves ([`ScopeOf`], owned in a [`Head`]) key the memory store.

use http::request::Parts;
use http::{Extensions, Method};
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

/// What a record's scope is taken over: the method, the route (axum's matched route
/// when there is one, else the path), the request's path and query, and the
/// principal, if any. The path and query are in it whatever the fingerprint setting,
/// so a key reused on another resource never replays this one's response.
///
/// Two requests have the same scope exactly when these are equal: the memory store
/// compares them as they are, and the stores shared between instances name records by
/// their [`digest`](Self::digest).
#[derive(Clone, Copy, Debug, Eq, Hash)]
pub(crate) struct ScopeOf<'a> {
    method: &'a str,
    route: &'a str,
    path: &'a str,
    query: &'a str,
    principal: Option<&'a str>,
}

impl PartialEq for ScopeOf<'_> {
    fn eq(&self, other: &Self) -> bool {
        same(self.path, other.path)
            && same(self.query, other.query)
            && same(self.method, other.method)
            && same(self.route, other.route)
            && match (self.principal, other.principal) {
                (Some(one), Some(other)) => same(one, other),
                (one, other) => one.is_none() && other.is_none(),
            }
    }
}

/// `one == other`, told at once when they are one string (a method's name, a route
/// or a layer's name shared with the router or the layer) or empty: a record is found
/// in memory by comparing seven short strings, and a call to `memcmp` for each was 7 %
/// of a replay.
pub(crate) fn same(one: &str, other: &str) -> bool {
    one.len() == other.len() && (one.as_ptr() == other.as_ptr() || one.is_empty() || one == other)
}

impl<'a> ScopeOf<'a> {
    pub(crate) fn new(parts: &'a Parts, principal: Option<&'a str>) -> Self {
        Self {
            method: parts.method.as_str(),
            route: route(&parts.extensions).unwrap_or(parts.uri.path()),
            path: parts.uri.path(),
            query: parts.uri.query().unwrap_or(""),
            principal,
        }
    }

    /// How many bytes the parts take.
    pub(crate) fn bytes(&self) -> usize {
        let principal = self.principal.map_or(0, str::len);
        self.method.len() + self.route.len() + self.path.len() + self.query.len() + principal
    }

    /// SHA-256 over the length-prefixed method, route, path and query, then the
    /// principal, in lowercase hex.
    pub(crate) fn digest(&self) -> Scope {
        let mut hasher = Sha256::new();
        for part in [self.method, self.route, self.path, self.query] {
            push_part(&mut hasher, part.as_bytes());
        }
        match self.principal {
            Some(principal) => {
                hasher.update([1]);
                push_part(&mut hasher, principal.as_bytes());
            }
            None => hasher.update([0]),
        }
        Scope::hex(&hasher.finalize().into())
    }
}

/// The parts of a request its [`ScopeOf`] reads, owned, for a record key that outlives
/// the request. The path and query are copied: hyper's are slices of the connection's
/// read buffer, which a record kept in memory must not keep alive.
#[derive(Clone)]
pub(crate) struct Head {
    method: Method,
    #[cfg(feature = "axum")]
    route: Option<axum::extract::MatchedPath>,
    /// The path, then the query.
    path_and_query: Box<str>,
    path_len: usize,
    principal: Option<Box<str>>,
}

impl Head {
    pub(crate) fn new(parts: &Parts, principal: Option<&str>) -> Self {
        let (path, query) = (parts.uri.path(), parts.uri.query().unwrap_or(""));
        Self {
            method: parts.method.clone(),
            #[cfg(feature = "axum")]
            route: parts.extensions.get().cloned(),
            path_and_query: [path, query].concat().into(),
            path_len: path.len(),
            principal: principal.map(Box::from),
        }
    }

    pub(crate) fn scope(&self) -> ScopeOf<'_> {
        let (path, query) = self.path_and_query.split_at(self.path_len);
        ScopeOf {
            method: self.method.as_str(),
            route: self.route().unwrap_or(path),
            path,
            query,
            principal: self.principal.as_deref(),
        }
    }

    #[cfg(feature = "axum")]
    fn route(&self) -> Option<&str> {
        self.route.as_ref().map(axum::extract::MatchedPath::as_str)
    }

    #[cfg(not(feature = "axum"))]
    fn route(&self) -> Option<&str> {
        None
    }
}

#[cfg(feature = "axum")]
fn route(extensions: &Extensions) -> Option<&str> {
    extensions
        .get::<axum::extract::MatchedPath>()
        .map(axum::extract::MatchedPath::as_str)
}

#[cfg(not(feature = "axum"))]
fn route(_: &Extensions) -> Option<&str> {
    None
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
    use proptest::prelude::*;
    use std::hash::BuildHasher;

    fn scope(parts: &Parts, principal: Option<&str>) -> Scope {
        ScopeOf::new(parts, principal).digest()
    }

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

    /// Records written by one build are checked by another: the fingerprint is SHA-256
    /// over the length-prefixed method, path, query and body (values from Python's
    /// `hashlib`).
    #[test]
    fn fingerprint_is_the_documented_digest() {
        let request = parts("POST", "/a?x=1");
        for (body, digest) in [
            (
                &b""[..],
                "06f60951b6041e39a4eeba0565bf121b50fac02076d2e60639d0949cd0dd025e",
            ),
            (
                &[b'x'; 64],
                "ea72bb607702c195526714a566936aa8253038f7275253e0c939987b4e0a04a9",
            ),
            (
                &[b'y'; 300],
                "6ea86e3aee19426af9e626ddc1b4bb9aefcba5149e295216175a000ff41b748a",
            ),
        ] {
            let hex: String = fingerprint(&request, body)
                .iter()
                .map(|byte| format!("{byte:02x}"))
                .collect();
            assert_eq!(hex, digest, "a body of {} bytes", body.len());
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

    fn scope_of() -> impl Strategy<Value = ScopeOf<'static>> {
        let text = |choices: &'static [&'static str]| prop::sample::select(choices);
        (
            text(&["GET", "POST", "PUT"]),
            text(&["/a", "/b", "/{id}", ""]),
            text(&["/a", "/b", "/a/b"]),
            text(&["", "x=1", "x=2"]),
            prop::option::of(text(&["", "alice", "bob"])),
        )
            .prop_map(|(method, route, path, query, principal)| ScopeOf {
                method,
                route,
                path,
                query,
                principal,
            })
    }

    proptest! {
        /// The memory store tells scopes apart by their parts, the shared stores by
        /// their digest: both must hold the same requests to be one scope, and equal
        /// parts must hash alike for the store's table.
        #[test]
        fn parts_are_equal_exactly_when_digests_are(one in scope_of(), other in scope_of()) {
            prop_assert_eq!(one == other, one.digest() == other.digest());
            if one == other {
                let state = std::hash::RandomState::new();
                prop_assert_eq!(state.hash_one(one), state.hash_one(other));
            }
        }

        /// A record key keeps its request's scope: its parts, owned, are the request's.
        #[test]
        fn a_head_keeps_the_scope_of_its_request(
            method in prop::sample::select(&["GET", "POST", "PATCH"][..]),
            uri in prop::sample::select(&["/a", "/a?", "/a?x=1", "/b/c?y"][..]),
            principal in prop::option::of(prop::sample::select(&["", "alice"][..])),
        ) {
            let request = parts(method, uri);
            let head = Head::new(&request, principal);
            prop_assert!(head.scope() == ScopeOf::new(&request, principal));
            prop_assert_eq!(head.scope().digest(), scope(&request, principal));
        }
    }
}
