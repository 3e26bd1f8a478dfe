//! The Lua scripts each master runs, each one atomic there. Renewal is the Redis
//! backend's own compare-and-`PEXPIRE` (`redis::scripts::RENEW`).

use crate::backend::redis::scripts::restart_guard;

/// `KEYS[1]` lock, `KEYS[2]` the token's given-back mark, `KEYS[3]` the holder record;
/// `ARGV[1]` token, `ARGV[2]` lease ms, `ARGV[3]` restart guard ms (0: off), `ARGV[4]`
/// instance id, `ARGV[5]` the record's TTL ms. `SET lock token NX PX lease`, with two
/// refusals around it; the record (token, grant ms, an empty fencing token, instance
/// id; one per line) is written with the grant. Returns `{1, 0}` when granted, `{0,
/// holder's PTTL}` when held (-2 when the token was given back), or `{2, ms until this
/// master votes}`.
///
/// Given back: an attempt that reaches a master after its own give-back (a slow or
/// frozen master) must not grant the key to a token nobody waits for any more.
///
/// Restart guard (see `redis::scripts::restart_guard!`):
/// a master up for less than a lease may have lost a key that a holder still counts in
/// its majority; its vote could complete a second majority, so it votes for nobody
/// until then. Looked at only once `SET NX` granted (a held key is refused anyway); a
/// refusal deletes that grant again in the same atomic script.
///
/// Calls, granted: `EXISTS` (the mark), `SET NX PX`, `TIME` (the guard's clock and the
/// record's time), `LASTSAVE` (the guard), `SET` (the record); refused: `EXISTS`, `SET
/// NX PX`, `PTTL`.
pub(super) const ACQUIRE: &str = concat!(
    r"
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, -2}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local now = redis.call('TIME')
",
    restart_guard!("ARGV[3]", "tonumber(now[1])", "redis.call('DEL', KEYS[1])"),
    r"
  local millis = now[1] .. string.sub('00' .. math.floor(now[2] / 1000), -3)
  redis.call('SET', KEYS[3], ARGV[1] .. '\n' .. millis .. '\n\n' .. ARGV[4], 'PX', ARGV[5])
  return {1, 0}
end
return {0, redis.call('PTTL', KEYS[1])}
"
);

/// `KEYS[1]` lock, `KEYS[2]` the token's given-back mark, `KEYS[3]` the holder record;
/// `ARGV[1]` token, `ARGV[2]` the mark's TTL ms. Deletes the lock (and its record) only
/// if the token holds it (1); if not, marks the token given back (see `ACQUIRE`) and
/// returns 0.
pub(super) const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[3])
  return 1
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 0
";
