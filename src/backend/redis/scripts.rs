//! The Lua scripts that acquire, renew and release a lock, each one atomic in Redis.

/// The restart guard, as Lua text for `concat!`: a server up for less than a lease may
/// have lost (restarted empty, or from an older snapshot) a key some instance still
/// believes it holds, for at most a lease after the restart, so it grants nothing until
/// then. `$guard` is the Lua expression of the guard in ms (the string `'0'`: off),
/// `$seconds` the server's time in whole seconds (from `TIME`), and `$refuse` a
/// statement run before it answers `{2, ms until grants resume}` (undoing a grant the
/// script just made, or nothing).
///
/// `uptime_in_seconds` is the difference of two whole-second clocks, short of the real
/// uptime by up to a second, so one second more is asked for. `LASTSAVE` answers
/// first, in O(1): Redis sets it to the time at startup and at every successful save,
/// never earlier, so time since the last save is a lower bound of the uptime, with the
/// same whole-second rounding. Only when that bound is too short (a server just
/// started, or one that saved within the guard) is `INFO server` read.
macro_rules! restart_guard {
    ($guard:literal, $seconds:literal, $refuse:literal) => {
        concat!(
            "if ",
            $guard,
            " ~= '0' then\n",
            "  local early = tonumber(",
            $guard,
            ") + 1000 - (",
            $seconds,
            " - redis.call('LASTSAVE')) * 1000\n",
            "  if early > 0 then\n",
            "    local info = redis.call('INFO', 'server')\n",
            "    local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))\n",
            "    early = tonumber(",
            $guard,
            ") + 1000 - uptime * 1000\n",
            "    if early > 0 then\n",
            "      ",
            $refuse,
            "\n",
            "      return {2, early}\n",
            "    end\n",
            "  end\n",
            "end\n"
        )
    };
}
pub(in crate::backend) use restart_guard;

/// Lua, for `concat!`: the last fencing token a holder record carries (its third line;
/// see `ACQUIRE`), as text, or `nil` when it has none. `$record` is a Lua expression of
/// the record's text, never `nil`. The one place that knows where the token is.
macro_rules! last_token {
    ($record:literal) => {
        concat!("string.match(", $record, r", '^[^\n]*\n[^\n]*\n(%d+)')")
    };
}
#[cfg(feature = "replay")]
pub(crate) use last_token;

/// Lua, for `concat!`: announces a release to the waiters, as `$message`, on the
/// release channel `$channel`, or, when `$channel` is empty (on a cluster), on the
/// lock's own shard channel `$lock`. The one place that knows where releases are heard.
macro_rules! announce {
    ($channel:literal, $lock:literal, $message:literal) => {
        concat!(
            "if ",
            $channel,
            " == '' then\n",
            "  redis.call('SPUBLISH', ",
            $lock,
            ", ",
            $message,
            ")\n",
            "else\n",
            "  redis.call('PUBLISH', ",
            $channel,
            ", ",
            $message,
            ")\n",
            "end\n"
        )
    };
}

/// `KEYS[1]` lock, `KEYS[2]` the holder record (it carries the last fencing token),
/// `KEYS[3]` waiting, `KEYS[4]` the token's given-back mark, `KEYS[5]` readers,
/// `KEYS[6]` writers' intent, `KEYS[7]` the queue, `KEYS[8]` permit holders,
/// optionally `KEYS[9]` a replay record to look for first;
/// `ARGV[1]` token, `ARGV[2]` lease ms, `ARGV[3]` the holder record's TTL ms (the
/// lease and the record window; 0: none), `ARGV[4]`
/// waiting-mark TTL ms, `ARGV[5]` restart guard ms (0: off), `ARGV[6]` the instance id,
/// `ARGV[7]` `1` if an earlier attempt of this token was sent (it may be in the intent
/// set), else `0`, `ARGV[8]` `1` if the caller takes a grant from a release (see
/// `RELEASE`), else `0`.
/// Returns `{1, fencing token}`, `{0, holder's PTTL}` (-2 when the token was given back;
/// a reader's or permit holder's expiry when they hold the key), `{2, ms until the
/// restart guard lets grants through}`, or `{3, the replay record}`.
///
/// Replay record: a completed request's stored response needs no lock to be replayed,
/// so when `KEYS[9]` exists the key is not taken (and this token leaves the writers'
/// intent it may have entered on an earlier attempt).
///
/// Given back: an attempt that arrives after its own give-back (it travelled on a
/// connection since replaced, and the give-back on the fresh one found the key free)
/// must not grant the key to a token nobody waits for any more.
///
/// Restart guard: see `restart_guard!`. It is looked at only once `SET NX` granted
/// the key (a held key is refused anyway), and a refusal deletes that grant again, in
/// the same atomic script: no command, and no one, sees it.
///
/// Fencing token: `max(last + 1, server time in µs)`, the last one read from the holder
/// record (see `last_token!`), so tokens keep growing when the record expired or went
/// back with lost writes, as long as the server clock does not step back. Both are
/// decimal text without leading zeros (the record's is only ever written so), so the
/// longer is the larger, and text of one length compares as the numbers do: the last
/// token is read as a number only when it is not below the clock (Lua's `tonumber` of
/// 16 digits costs more than the rest of the grant). Returned as that text (16
/// digits: exact in a Lua number, a double, but not in its default formatting).
///
/// Queue: a writer refused that takes a grant from a release leaves, in the queue, the
/// lease, fence TTL and instance id the release grants it with. Once granted so, its
/// next attempt finds the key its own: the lease then counts from this attempt.
///
/// When not granted, the waiting mark tells the holder's release to publish. Its TTL
/// outlasts the caller's pause before the next attempt (which marks again), and is
/// only ever extended, so a waiter with a longer pause keeps its mark.
///
/// Readers (shared holders, see `ACQUIRE_COUNTED`) hold the key as much as a writer:
/// while an unexpired one is left, the key is held, until the one that expires first
/// (expired ones are pruned by the scripts of shared holders, and go with the set's
/// TTL). A writer refused enters its token in the intent set (scored by the waiting
/// mark's expiry, in ms with the µs of `TIME` as a fraction: the release grants in
/// this order, and two writers refused within one ms must keep theirs) and takes it
/// out when granted: while it is there, no new reader enters.
///
/// Permit holders (`ACQUIRE_COUNTED` with permits) hold the key against writers as
/// readers do: an instance configured with permits and one exclusive under the same
/// name exclude each other. Their set is read (one `ZRANGEBYSCORE`) only when no
/// reader holds the key; a writer refused by them enters the intent as above, and
/// while it is there no new permit holder enters either.
///
/// A plain exclusive grant is on every lock's path, so it makes few calls: one
/// `EXISTS` for the given-back mark, readers and permit holders together (each looked
/// at only if one of them exists), one `TIME`, `SET NX` for the lock, `LASTSAVE` for
/// the restart guard, the holder record read (for the last token) and written once,
/// and the intent left only by a token that may have entered it.
pub(super) const ACQUIRE: &str = concat!(
    r"
local marked = redis.call('EXISTS', KEYS[4], KEYS[5], KEYS[8])
if marked > 0 and redis.call('EXISTS', KEYS[4]) == 1 then
  return {0, -2}
end
if KEYS[9] then
  local stored = redis.call('GET', KEYS[9])
  if stored then
    redis.call('ZREM', KEYS[6], ARGV[1])
    return {3, stored}
  end
end
local clock = redis.call('TIME')
local now = nil
local reader = nil
if marked > 0 then
  now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  reader = redis.call('ZRANGEBYSCORE', KEYS[5], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if reader[1] == nil then
    reader = redis.call('ZRANGEBYSCORE', KEYS[8], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  end
  if reader[1] == nil then
    reader = nil
  end
end
if reader == nil then
  if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
",
    restart_guard!(
        "ARGV[5]",
        "tonumber(clock[1])",
        "redis.call('DEL', KEYS[1])"
    ),
    r"
    local micros = clock[1] .. string.sub('00000' .. clock[2], -6)
    local text = micros
    local last = ",
    last_token!("redis.call('GET', KEYS[2]) or ''"),
    r"
    if last and (#last > #micros or (#last == #micros and last >= micros)) then
      text = string.format('%d', tonumber(last) + 1)
    end
    local record = ARGV[1] .. '\n' .. string.sub(micros, 1, -4) .. '\n' .. text .. '\n' .. ARGV[6]
    if ARGV[3] ~= '0' then
      redis.call('SET', KEYS[2], record, 'PX', ARGV[3])
    else
      redis.call('SET', KEYS[2], record)
    end
    if ARGV[7] == '1' then
      redis.call('ZREM', KEYS[6], ARGV[1])
      if ARGV[8] == '1' then
        redis.call('HDEL', KEYS[7], ARGV[1])
      end
    end
    return {1, text}
  end
  if ARGV[8] == '1' and redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, ",
    last_token!("redis.call('GET', KEYS[2]) or ''"),
    r"}
  end
end
now = now or tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
end
local order = now + tonumber(ARGV[4]) + (tonumber(clock[2]) % 1000) / 1000
redis.call('ZADD', KEYS[6], string.format('%.3f', order), ARGV[1])
if redis.call('PTTL', KEYS[6]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[6], ARGV[4])
end
if ARGV[8] == '1' then
  redis.call('HSET', KEYS[7], ARGV[1], ARGV[2] .. '\n' .. ARGV[3] .. '\n' .. ARGV[6])
  if redis.call('PTTL', KEYS[7]) < tonumber(ARGV[4]) then
    redis.call('PEXPIRE', KEYS[7], ARGV[4])
  end
end
if reader ~= nil then
  return {0, tonumber(reader[2]) - now}
end
return {0, redis.call('PTTL', KEYS[1])}
"
);

/// `KEYS[1]` lock, `KEYS[2]` holder record. `{}` when the key is free, else `{token,
/// PTTL}` and, if the record is the current holder's (it starts with the lock's
/// token), the rest of the record: grant time ms, fencing token, instance id, one per
/// line. Redlock reads it on each master (the token tells which holder a majority
/// names).
pub(in crate::backend) const HOLDER: &str = r"
local token = redis.call('GET', KEYS[1])
if not token then
  return {}
end
local pttl = redis.call('PTTL', KEYS[1])
local record = redis.call('GET', KEYS[2])
if record and string.sub(record, 1, #token + 1) == token .. '\n' then
  return {token, pttl, string.sub(record, #token + 2)}
end
return {token, pttl}
";

/// `KEYS[1]` lock, then the records that live with it (the holder record, which
/// carries the last fencing token; Redlock's holder record); `ARGV[1]` token, `ARGV[2]` lease ms, `ARGV[3]` the
/// records' TTL ms (absent or 0: left as they are). 1 if still ours and extended. The
/// records outlive the lock by their window, however long it is held.
pub(in crate::backend) const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[3] and ARGV[3] ~= '0' then
    for i = 2, #KEYS do
      redis.call('PEXPIRE', KEYS[i], ARGV[3])
    end
  end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// `KEYS[1]` lock, `KEYS[2]` waiting, `KEYS[3]` the token's given-back mark, `KEYS[4]`
/// writers' intent, `KEYS[5]` the queue, `KEYS[6]` the holder record;
/// `ARGV[1]` token, `ARGV[2]` release channel, or empty on a cluster: there the lock's
/// own shard channel, named like the lock key; `ARGV[3]` the mark's TTL ms. 1 if the
/// lock was still ours; if not, takes the token out of the intent and the queue, marks
/// it given back (see `ACQUIRE`) and returns 0: so this is also how a waiter leaves.
///
/// Released, the lock goes at once to the first writer in the intent set that is still
/// waiting (its entry not expired) and queued: granted as `ACQUIRE` grants, with the
/// lease it queued with, and announced as `lock\ntoken\nfencing token\nlease ms`, so the
/// waiter holds it without a round trip of its own (and the others wait at most that
/// lease before they try again). No reader or permit holder can hold the key here:
/// `ACQUIRE` grants the lock only when no unexpired one is left, `ACQUIRE_COUNTED`
/// refuses both while the lock is held, and a renewal never brings an expired one
/// back; so the hand-off needs no look at their sets. Without such a writer the lock and
/// the waiting mark are deleted in one `DEL` (the lock was there: a count of 2 says a
/// waiter marked the key), and only then the release announced (the lock key alone):
/// an uncontended release publishes nothing.
pub(super) const RELEASE: &str = concat!(
    r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
  return 0
end
if redis.call('EXISTS', KEYS[5]) == 1 then
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  local waiters = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. now, '+inf', 'LIMIT', 0, 8)
  for _, token in ipairs(waiters) do
    local queued = redis.call('HGET', KEYS[5], token)
    if queued then
      local lease, fence_ttl, instance = string.match(queued, '^(%d+)\n(%d+)\n(.*)$')
      redis.call('SET', KEYS[1], token, 'PX', lease)
      local micros = tonumber(clock[1] .. string.sub('00000' .. clock[2], -6))
      local last = ",
    last_token!("redis.call('GET', KEYS[6]) or ''"),
    r"
      local fence = math.max(tonumber(last or '0') + 1, micros)
      local text = string.format('%d', fence)
      local millis = clock[1] .. string.sub('00' .. math.floor(clock[2] / 1000), -3)
      local record = token .. '\n' .. millis .. '\n' .. text .. '\n' .. instance
      if fence_ttl ~= '0' then
        redis.call('SET', KEYS[6], record, 'PX', fence_ttl)
      else
        redis.call('SET', KEYS[6], record)
      end
      redis.call('ZREM', KEYS[4], token)
      redis.call('HDEL', KEYS[5], token)
      local message = KEYS[1] .. '\n' .. token .. '\n' .. text .. '\n' .. lease
",
    announce!("ARGV[2]", "KEYS[1]", "message"),
    r"
      return 1
    end
  end
end
if redis.call('DEL', KEYS[1], KEYS[2]) == 2 then
",
    announce!("ARGV[2]", "KEYS[1]", "KEYS[1]"),
    r"
end
return 1
"
);

/// A replay record written and the lock released, in one step. `KEYS[1]` lock,
/// `KEYS[2]` the holder record, `KEYS[3]` waiting, `KEYS[4]` the record; `ARGV[1]` the
/// holder's fencing token, `ARGV[2]` the record, `ARGV[3]` its TTL ms, `ARGV[4]`
/// release channel, or empty on a cluster (the lock's shard channel). Only while the
/// lock is held and no grant came after the holder's (the holder record still carries
/// its token): then
/// writes, deletes the lock, announces the release as `RELEASE` does, and returns 1;
/// else changes nothing and returns 0.
#[cfg(feature = "replay")]
pub(super) const PUT_AND_RELEASE: &str = concat!(
    r"
local record = redis.call('GET', KEYS[2]) or ''
if redis.call('EXISTS', KEYS[1]) == 1 and ",
    last_token!("record"),
    r" == ARGV[1] then
  redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
  if redis.call('DEL', KEYS[1], KEYS[3]) == 2 then
",
    announce!("ARGV[4]", "KEYS[1]", "KEYS[1]"),
    r"
  end
  return 1
end
return 0
"
);

/// Takes one place among a key's shared or permit holders. `KEYS[1]` lock, `KEYS[2]`
/// the holder record (for the last fencing token), `KEYS[3]` waiting, `KEYS[4]` the
/// token's given-back mark, `KEYS[5]` the holders (readers or permits: tokens scored
/// by expiry, server ms), `KEYS[6]` the writers' intent (`KEYS[7]` and `KEYS[8]` are
/// not used); `ARGV[1]` token, `ARGV[2]` lease ms, `ARGV[3]` the holder record's TTL
/// ms (0: none), `ARGV[4]` waiting-mark TTL ms, `ARGV[5]` restart guard ms (0: off),
/// `ARGV[6]` the instance id (not used), `ARGV[7]` permits (0: a reader, unbounded but
/// for writers). Answers as `ACQUIRE` does; a reader's fencing token is the key's last
/// one (-1 if none), a permit holder's a new one, written as a holder record with no
/// token (no exclusive holder is named by it).
///
/// Expired holders are pruned first, so a crashed holder's place comes back one lease
/// after its last grant or renewal. A reader or a permit holder is refused while a
/// writer holds the key or waits for it (the intent set, pruned the same way): an
/// instance with permits and an exclusive one under the same name exclude each other,
/// and a stream of permit holders cannot starve the writer. A permit holder is also
/// refused while `ARGV[7]` places are taken: each acquirer counts against its own `n`,
/// so instances configured with different `n` share one set of holders and none
/// enters while as many as its own `n` hold. Readers and permit holders do not
/// exclude each other (both hold the key against writers only). The set's own TTL is
/// only ever extended, to the latest holder's expiry.
pub(super) const ACQUIRE_COUNTED: &str = concat!(
    r"
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {0, -2}
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
local busy = nil
local limit = tonumber(ARGV[7])
if redis.call('EXISTS', KEYS[1]) == 1 then
  busy = redis.call('PTTL', KEYS[1])
else
  local writer = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  if writer[1] ~= nil then
    busy = tonumber(writer[2]) - now
  end
end
if busy == nil and limit > 0 and redis.call('ZCARD', KEYS[5]) >= limit then
  local first = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
  busy = tonumber(first[2]) - now
end
if busy ~= nil then
  if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[4]) then
    redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
  end
  return {0, busy}
end
",
    restart_guard!("ARGV[5]", "tonumber(clock[1])", ""),
    r"
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('PTTL', KEYS[5]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[5], ARGV[2])
end
local last = ",
    last_token!("redis.call('GET', KEYS[2]) or ''"),
    r"
if limit == 0 then
  return {1, last or -1}
end
local micros = tonumber(clock[1] .. string.sub('00000' .. clock[2], -6))
local text = string.format('%d', math.max(tonumber(last or '0') + 1, micros))
local record = '\n' .. math.floor(micros / 1000) .. '\n' .. text .. '\n'
if ARGV[3] ~= '0' then
  redis.call('SET', KEYS[2], record, 'PX', ARGV[3])
else
  redis.call('SET', KEYS[2], record)
end
return {1, text}
"
);

/// `KEYS[1]` the holders; `ARGV[1]` token, `ARGV[2]` lease ms. 1 if the token is still
/// among them, unexpired, and now holds for `ARGV[2]` more.
pub(super) const RENEW_COUNTED: &str = r"
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if expiry and tonumber(expiry) > now then
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return 1
end
return 0
";

/// `KEYS[1]` the holders, `KEYS[2]` waiting, `KEYS[3]` the token's given-back mark,
/// `KEYS[4]` lock (the name a release is announced by); `ARGV[1]` token, `ARGV[2]`
/// release channel, or empty on a cluster (the lock's shard channel); `ARGV[3]` the
/// mark's TTL ms. Takes the token out of the holders and announces it if a waiter
/// marked the key: 1. If it was not there, marks it given back (see `ACQUIRE`): 0.
pub(super) const RELEASE_COUNTED: &str = concat!(
    r"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  if redis.call('DEL', KEYS[2]) == 1 then
",
    announce!("ARGV[2]", "KEYS[4]", "KEYS[4]"),
    r"
  end
  return 1
end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
return 0
"
);
