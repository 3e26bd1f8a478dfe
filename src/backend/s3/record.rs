//! The body of a lock object (see [the object](super#the-object)): who holds the key,
//! for how long a waiter watches it, and the last fencing token issued.
//!
//! Every write carries a fresh random record version, so its ETag (on S3 the MD5 of
//! the body) differs from every earlier one: a waiter that sees the same ETag a lease
//! later knows that nothing was written in between.

use std::time::Duration;

/// The first line of every lock object: an object without it was not written by this
/// crate, and no token is issued from it.
const MAGIC: &str = "tower-keyed-lock s3 1";

/// A lock object, as read or about to be written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Record {
    /// The holder's random token; `None` while the key is free (released, its object
    /// not yet deleted).
    pub(super) owner: Option<String>,
    /// The fencing token of the latest grant.
    pub(super) fence: u64,
    /// The holder's lease: how long a waiter watches an unchanged ETag.
    pub(super) lease: Duration,
    /// The holder's instance id.
    pub(super) instance: Option<String>,
    /// When it was granted, ms since the epoch on the holder's clock.
    pub(super) since_ms: Option<u64>,
}

impl Record {
    /// The object's body with `version`, a fresh random record version.
    pub(super) fn render(&self, version: &str) -> Vec<u8> {
        let mut body = format!("{MAGIC}\nversion {version}\nfence {}\n", self.fence);
        body.push_str(&format!("lease_ms {}\n", self.lease.as_millis()));
        if let Some(owner) = &self.owner {
            body.push_str(&format!("owner {owner}\n"));
        }
        if let Some(since) = self.since_ms {
            body.push_str(&format!("since_ms {since}\n"));
        }
        if let Some(instance) = &self.instance {
            // One line: an instance id with line breaks loses them.
            let instance = instance.replace(['\n', '\r'], " ");
            body.push_str(&format!("holder {instance}\n"));
        }
        body.into_bytes()
    }

    /// The record in `body`; why not, for a body this crate did not write.
    pub(super) fn parse(body: &[u8]) -> Result<Record, String> {
        let unreadable = || {
            let shown: String = String::from_utf8_lossy(body).chars().take(64).collect();
            format!("{shown:?}")
        };
        let text = std::str::from_utf8(body).map_err(|_| unreadable())?;
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err(unreadable());
        }
        let (mut owner, mut fence, mut lease, mut instance, mut since_ms) =
            (None, None, None, None, None);
        for line in lines {
            let (field, value) = line.split_once(' ').unwrap_or((line, ""));
            match field {
                "owner" => owner = Some(value.to_owned()),
                "fence" => fence = value.parse().ok(),
                "lease_ms" => lease = value.parse().ok().map(Duration::from_millis),
                "holder" => instance = Some(value.to_owned()),
                "since_ms" => since_ms = value.parse().ok(),
                _ => {}
            }
        }
        match (fence, lease) {
            (Some(fence), Some(lease)) => Ok(Record {
                owner,
                fence,
                lease,
                instance,
                since_ms,
            }),
            _ => Err(unreadable()),
        }
    }

    /// The same record with nobody holding it: what a release leaves until the object
    /// is deleted. The fencing token stays, so a grant before the delete counts on.
    pub(super) fn freed(&self) -> Record {
        Record {
            owner: None,
            instance: None,
            since_ms: None,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held() -> Record {
        Record {
            owner: Some("0123abcd".into()),
            fence: 1_800_000_000_000_001,
            lease: Duration::from_secs(30),
            instance: Some("web-2:42".into()),
            since_ms: Some(1_800_000_000_000),
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let record = held();
        assert_eq!(Record::parse(&record.render("v1")).unwrap(), record);
        let freed = record.freed();
        assert_eq!(freed.owner, None);
        assert_eq!(freed.fence, record.fence);
        assert_eq!(Record::parse(&freed.render("v2")).unwrap(), freed);
    }

    #[test]
    fn every_version_is_another_body() {
        let record = held();
        assert_ne!(record.render("v1"), record.render("v2"));
    }

    #[test]
    fn foreign_bodies_are_refused() {
        for body in [
            &b""[..],
            b"hello",
            b"tower-keyed-lock s3 1\nowner x\n",
            b"\xff",
        ] {
            assert!(Record::parse(body).is_err(), "{body:?}");
        }
        let instance = Record {
            instance: Some("a\nowner b".into()),
            ..held()
        };
        let read = Record::parse(&instance.render("v")).unwrap();
        assert_eq!(read.owner, held().owner);
        assert_eq!(read.instance.as_deref(), Some("a owner b"));
    }
}
