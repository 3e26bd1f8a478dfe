//! A stored response, which of its headers are kept, and its byte encoding.

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, StatusCode};

// From the error file itself: the store module imports this one for `Record`.
use super::store::error::StoreError;

/// Headers replayed by default; [`ReplayLayer::replay_header`](super::ReplayLayer::replay_header)
/// adds more. `Content-Length` is not stored: the replay computes it again.
pub const DEFAULT_REPLAYED_HEADERS: &[HeaderName] = &[
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::CONTENT_DISPOSITION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
    header::EXPIRES,
    header::VARY,
    header::LINK,
];

/// Never stored, even when allow-listed: they belong to one client's session or to one
/// authentication exchange.
const NEVER_REPLAYED: &[HeaderName] = &[
    header::SET_COOKIE,
    header::WWW_AUTHENTICATE,
    header::PROXY_AUTHENTICATE,
];

/// Whether a header named `name` may be stored, given the `allowed` list.
pub(crate) fn is_replayable(name: &HeaderName, allowed: &[HeaderName]) -> bool {
    allowed.contains(name) && !NEVER_REPLAYED.contains(name)
}

/// The SHA-256 fingerprint of a request: over its method, path, query and body, each
/// prefixed by its length as a big-endian `u64`.
pub type Fingerprint = [u8; 32];

/// A completed response as a store keeps it: the fingerprint of the request that made
/// it, its status, its allow-listed headers (every value of a multi-valued one, in
/// order) and its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    fingerprint: Option<Fingerprint>,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

/// Marks the encoding, so a later format can be told apart.
const MAGIC: &[u8; 4] = b"KLR1";

impl Record {
    /// A record of a response with `status`, the headers of `headers` that `allowed`
    /// lets through, and `body`.
    pub(crate) fn new(
        fingerprint: Option<Fingerprint>,
        status: StatusCode,
        headers: &HeaderMap,
        allowed: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let mut kept = HeaderMap::new();
        for (name, value) in headers {
            if is_replayable(name, allowed) {
                kept.append(name.clone(), value.clone());
            }
        }
        Self {
            fingerprint,
            status,
            headers: kept,
            body,
        }
    }

    /// The fingerprint of the request that made the response (`None` when
    /// fingerprinting was off).
    pub fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stored headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The response body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The status, the kept headers and the body, to build a response from.
    pub(crate) fn into_parts(self) -> (StatusCode, HeaderMap, Bytes) {
        (self.status, self.headers, self.body)
    }

    /// About how many bytes the record takes (what the memory store counts).
    pub fn weight(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 8)
            .sum();
        64 + headers + self.body.len()
    }

    /// The record as bytes, for stores that keep bytes: `KLR1`, a fingerprint flag and
    /// the fingerprint, the status as a big-endian `u16`, the header count as `u32`,
    /// each header as `u32` name length, name, `u32` value length, value; then the body.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.weight());
        out.extend_from_slice(MAGIC);
        match &self.fingerprint {
            Some(fingerprint) => {
                out.push(1);
                out.extend_from_slice(fingerprint);
            }
            None => out.push(0),
        }
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        push_len(&mut out, self.headers.len());
        for (name, value) in &self.headers {
            push_len(&mut out, name.as_str().len());
            out.extend_from_slice(name.as_str().as_bytes());
            push_len(&mut out, value.len());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads bytes written by [`to_bytes`](Self::to_bytes); anything else is an error,
    /// never a panic.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StoreError> {
        let corrupt = || StoreError::new("a stored record is corrupt");
        let mut reader = Reader(bytes);
        if reader.take(MAGIC.len()).ok_or_else(corrupt)? != MAGIC {
            return Err(corrupt());
        }
        let fingerprint = match reader.take(1).ok_or_else(corrupt)? {
            [0] => None,
            [1] => Some(
                Fingerprint::try_from(reader.take(32).ok_or_else(corrupt)?)
                    .map_err(|_| corrupt())?,
            ),
            _ => return Err(corrupt()),
        };
        let status = reader.take(2).ok_or_else(corrupt)?;
        let status = StatusCode::from_u16(u16::from_be_bytes([status[0], status[1]]))
            .map_err(|_| corrupt())?;
        let count = reader.len().ok_or_else(corrupt)?;
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name_len = reader.len().ok_or_else(corrupt)?;
            let name = HeaderName::from_bytes(reader.take(name_len).ok_or_else(corrupt)?)
                .map_err(|_| corrupt())?;
            let value_len = reader.len().ok_or_else(corrupt)?;
            let value = HeaderValue::from_bytes(reader.take(value_len).ok_or_else(corrupt)?)
                .map_err(|_| corrupt())?;
            headers.append(name, value);
        }
        Ok(Self {
            fingerprint,
            status,
            headers,
            body: Bytes::copy_from_slice(reader.0),
        })
    }
}

fn push_len(out: &mut Vec<u8>, len: usize) {
    // Header names, values and counts are far below 4 GiB: `http` caps them.
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
}

/// Reads from the front of a byte slice, `None` past its end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(taken)
    }

    fn len(&mut self) -> Option<usize> {
        let bytes = self.take(4)?;
        usize::try_from(u32::from_be_bytes(bytes.try_into().ok()?)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Record {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.append(header::VARY, HeaderValue::from_static("accept"));
        headers.append(header::VARY, HeaderValue::from_static("origin"));
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("session=1"));
        headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Basic"));
        headers.insert("x-request-id", HeaderValue::from_static("7"));
        let mut allowed = DEFAULT_REPLAYED_HEADERS.to_vec();
        allowed.push(header::SET_COOKIE);
        Record::new(
            Some([7; 32]),
            StatusCode::CREATED,
            &headers,
            &allowed,
            Bytes::from_static(b"made"),
        )
    }

    #[test]
    fn keeps_allowed_multi_valued_headers_and_never_cookies_or_challenges() {
        let record = sample();
        let vary: Vec<_> = record.headers().get_all(header::VARY).iter().collect();
        assert_eq!(vary, ["accept", "origin"]);
        assert_eq!(record.headers()[header::CONTENT_TYPE], "text/plain");
        assert!(record.headers().get(header::SET_COOKIE).is_none());
        assert!(record.headers().get(header::WWW_AUTHENTICATE).is_none());
        assert!(record.headers().get("x-request-id").is_none());
    }

    #[test]
    fn round_trips_through_bytes() {
        let record = sample();
        assert_eq!(Record::from_bytes(&record.to_bytes()).unwrap(), record);
        let plain = Record::new(None, StatusCode::OK, &HeaderMap::new(), &[], Bytes::new());
        assert_eq!(Record::from_bytes(&plain.to_bytes()).unwrap(), plain);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample().to_bytes();
        let body_starts = bytes.len() - 4;
        for end in 0..body_starts {
            assert!(Record::from_bytes(&bytes[..end]).is_err(), "{end}");
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Record::from_bytes(&bytes);
        }
    }
}
