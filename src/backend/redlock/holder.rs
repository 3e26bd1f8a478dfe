//! Who holds a key (see [Who holds a key](super#who-holds-a-key)): a majority read.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::lease::NoMajority;
use super::quorum::ask_all;
use super::Inner;
use crate::backend::holder::from_unix_millis;
use crate::backend::redis::keys::RedisKeys;
use crate::backend::Holder;
use crate::error::LockError;

impl Inner {
    /// Asks every master; the holder is the token a majority has. Its record comes from
    /// one of those masters, its lease left is the least any of them reports.
    pub(super) async fn holder(
        self: Arc<Self>,
        keys: Arc<RedisKeys>,
    ) -> Result<Option<Holder>, LockError> {
        let majority = self.masters.len() / 2 + 1;
        let mut answered = 0;
        let mut failed = Vec::new();
        let mut tokens: HashMap<String, (usize, i64, Option<String>)> = HashMap::new();
        let ask = |master: usize| {
            let (inner, keys) = (self.clone(), keys.clone());
            async move { (master, inner.masters[master].holder(&keys).await) }
        };
        ask_all(self.masters.len(), ask, |(master, answer)| {
            let view = match answer {
                Ok(view) => view,
                Err(error) => {
                    failed.push((self.masters[master].address.clone(), error.to_string()));
                    return false;
                }
            };
            answered += 1;
            if let Some((token, pttl, rest)) = view {
                let entry = tokens.entry(token).or_insert((0, i64::MAX, None));
                entry.0 += 1;
                entry.1 = entry.1.min(pttl);
                entry.2 = entry.2.take().or(rest);
            }
            false
        })
        .await;
        if answered < majority {
            let error = NoMajority {
                answered,
                masters: self.masters.len(),
                failed,
            };
            return Err(LockError::Backend(Box::new(error)));
        }
        let Some((_, pttl, rest)) = tokens.into_values().find(|(votes, ..)| *votes >= majority)
        else {
            return Ok(None);
        };
        let mut holder = Holder::new();
        if let Ok(left) = u64::try_from(pttl) {
            holder = holder.with_lease_left(Duration::from_millis(left));
        }
        if let Some(rest) = rest {
            let mut fields = rest.splitn(3, '\n');
            if let Some(millis) = fields.next().and_then(|m| m.parse().ok()) {
                holder = holder.with_since(from_unix_millis(millis));
            }
            let _no_fencing_token = fields.next();
            if let Some(instance) = fields.next() {
                holder = holder.with_instance(instance);
            }
        }
        Ok(Some(holder))
    }
}
