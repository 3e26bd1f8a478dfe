//! The Lua scripts that acquire, renew and release a lock, each one atomic in Redis.

/// `KEYS[1]` lock, `KEYS[2]` fence, `KEYS[3]` waiting, `KEYS[4]` the token's given-back
/// mark, `KEYS[5]` the holder record; `ARGV[1]` token, `ARGV[2]` lease ms, `ARGV[3]`
/// fence TTL ms (0: none), `ARGV[4]` waiting-mark TTL ms, `ARGV[5]` restart guard ms
/// (0: off), `ARGV[6]` the instance id. Returns `{1, fencing
/// token}`, `{0, holder's PTTL}` (-2 when the token was given back), or `{2, ms until
/// the restart guard lets grants through}`.
///
/// Given back: an attempt that arrives after its own give-back (it travelled on a
/// connection since replaced, and the give-back on the fresh one found the key free)
/// must not grant the key to a token nobody waits for any more.
///
/// Restart guard: a server up for less than a lease may have lost (restarted empty,
/// or from an older snapshot) a key some instance still believes it holds, for at
/// most a lease after the restart; it grants nothing until then. `uptime_in_seconds`
/// is the difference of two whole-second clocks, short of the real uptime by up to a
/// second, so one second more is asked for.
///
/// Fencing token: `max(counter + 1, server time in µs)`, so tokens keep growing when
/// the counter expired or went back with lost writes, as long as the server clock
/// does not step back. The time is kept as text: it has 16 digits, exact in a Lua
/// number (a double) but not worth risking in a `SET`.
///
/// When not granted, the waiting mark tells the holder's release to publish. Its TTL
/// outlasts the caller's pause before the next attempt (which marks again), and is
/// only ever extended, so a waiter with a longer pause keeps its mark.
pub(super) const ACQUIRE: &str = r"
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {0, -2}
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[5] ~= '0' then
    local info = redis.call('INFO', 'server')
    local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
    local early = tonumber(ARGV[5]) + 1000 - uptime * 1000
    if early > 0 then
      return {2, early}
    end
  end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  local now = redis.call('TIME')
  local micros = now[1] .. string.sub('00000' .. now[2], -6)
  local fence = redis.call('INCR', KEYS[2])
  if fence < tonumber(micros) then
    redis.call('SET', KEYS[2], micros)
    fence = tonumber(micros)
  end
  local millis = now[1] .. string.sub('00' .. math.floor(now[2] / 1000), -3)
  local record = ARGV[1] .. '\n' .. millis .. '\n' .. redis.call('GET', KEYS[2]) .. '\n' .. ARGV[6]
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    redis.call('SET', KEYS[5], record, 'PX', ARGV[3])
  else
    redis.call('SET', KEYS[5], record)
  end
  return {1, fence}
end
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
end
return {0, redis.call('PTTL', KEYS[1])}
";

/// `KEYS[1]` lock, `KEYS[2]` holder record. `{}` when the key is free, else `{PTTL}`
/// and, if the record is the current holder's (it starts with the lock's token), the
/// rest of the record: grant time ms, fencing token, instance id, one per line.
pub(super) const HOLDER: &str = r"
local token = redis.call('GET', KEYS[1])
if not token then
  return {}
end
local pttl = redis.call('PTTL', KEYS[1])
local record = redis.call('GET', KEYS[2])
if record and string.sub(record, 1, #token + 1) == token .. '\n' then
  return {pttl, string.sub(record, #token + 2)}
end
return {pttl}
";

/// `KEYS[1]` lock; `ARGV[1]` token, `ARGV[2]` lease ms. 1 if still ours and extended.
pub(in crate::backend) const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// `KEYS[1]` lock, `KEYS[2]` waiting, `KEYS[3]` the token's given-back mark; `ARGV[1]`
/// token, `ARGV[2]` release channel, or empty on a cluster: there the lock's own shard
/// channel, named like the lock key; `ARGV[3]` the mark's TTL ms. Deletes the lock only
/// if it is still ours, and announces it if a waiter marked the key (an uncontended
/// release publishes nothing). 1 if deleted; if not ours, marks the token given back
/// (see `ACQUIRE`) and returns 0.
pub(super) const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('DEL', KEYS[2]) == 1 then
    if ARGV[2] == '' then
      redis.call('SPUBLISH', KEYS[1], KEYS[1])
    else
      redis.call('PUBLISH', ARGV[2], KEYS[1])
    end
  end
  return 1
end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
return 0
";
