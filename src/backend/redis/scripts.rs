//! The Lua scripts that acquire, renew and release a lock, each one atomic in Redis.

/// `KEYS[1]` lock, `KEYS[2]` fence, `KEYS[3]` waiting; `ARGV[1]` token, `ARGV[2]` lease
/// ms, `ARGV[3]` fence TTL ms (0: none), `ARGV[4]` waiting-mark TTL ms. Returns
/// `{1, fencing token}` or `{0, holder's PTTL}`.
///
/// A missing fence counter starts from the server clock in microseconds, so tokens keep
/// growing after the counter expired or Redis lost its data (as long as that clock does
/// not step back). The seed is concatenated as text: Lua numbers are doubles.
///
/// When not granted, the waiting mark tells the holder's release to publish. Its TTL
/// outlasts the caller's pause before the next attempt (which marks again), and is
/// only ever extended, so a waiter with a longer pause keeps its mark.
pub(super) const ACQUIRE: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  if fence == 1 then
    local now = redis.call('TIME')
    redis.call('SET', KEYS[2], now[1] .. string.sub('00000' .. now[2], -6))
    fence = redis.call('INCR', KEYS[2])
  end
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  return {1, fence}
end
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
end
return {0, redis.call('PTTL', KEYS[1])}
";

/// `KEYS[1]` lock; `ARGV[1]` token, `ARGV[2]` lease ms. 1 if still ours and extended.
pub(super) const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// `KEYS[1]` lock, `KEYS[2]` waiting; `ARGV[1]` token, `ARGV[2]` release channel.
/// Deletes the lock only if it is still ours, and announces it if a waiter marked the
/// key (an uncontended release publishes nothing). 1 if deleted.
pub(super) const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('DEL', KEYS[2]) == 1 then
    redis.call('PUBLISH', ARGV[2], KEYS[1])
  end
  return 1
end
return 0
";
