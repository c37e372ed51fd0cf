#!lua name=clickagg_dedup_v1
--
-- The dedup cache's only writer. src/dedup/mod.rs states the definition; decide.rs
-- holds this same logic in Rust (`decide_shared`), where the property test checks it.
--
-- Keys come in groups (one group per Redis Cluster hash tag; a single Redis has one),
-- and every call touches one group only (a Redis Cluster runs a function only on keys
-- of one slot). Within a group, everything lives in a *namespace*: a random name the
-- group's key `ns` holds. A cache that lost its data (a Redis restarted without
-- persistence, a failover to an empty replica, FLUSHALL) has no `ns` key, or one a
-- member never saw; every call checks it against the namespace the caller uses and
-- answers LOST instead of deciding from nothing. The member then moves everyone to a
-- new namespace and rebuilds it from the log (src/cache/namespace.rs).
--
-- Per namespace:
--   shard hashes   field = a fingerprint's low 88 bits (11 bytes); value = the items of
--                  every partition that sighted the click: usually one 12-byte chain,
--                  '>HI6I4': the partition (bit 15 set when the chain counted), the
--                  offset where the chain started, and the record time (s) of its
--                  latest sighting. Bit 14 marks a 17-byte item, '>HBI6I4I4', with a
--                  flags byte (bits 0-1: its start counted 0, was a cross-partition
--                  copy 1, or a duplicate 2; bit 2: a sighting judged ahead of its
--                  partition's clock) and a reach: the partition clock it matters
--                  within a window of (decide.rs, `Chain::reach`) — for a sighting
--                  judged ahead, the clock it was read at or confirmed to; for a chain
--                  (a 17-byte one starts with a duplicate: it continues a sighting
--                  judged ahead), its latest sighting, like a 12-byte chain's. The
--                  sweeper keeps an item by its reach. Partitions below 16 384.
--   frontier       field = partition, value = '>I6I4I6': one past the highest offset of
--                  that partition claimed through this group (0: none yet), the record
--                  time there, and the offset
--                  from which the entries are exact for re-reads (a warm-up that rebuilt
--                  lost state makes them exact from the boundary it counted from); a claim
--                  at or below the highest offset is a re-read, which never changes an
--                  entry. "Claimed through": the client sends every group the highest
--                  offset of each partition in the poll batch (a mark), also groups that
--                  got none of its clicks, so all groups' frontiers agree once every call
--                  of a batch succeeded. A partition is *ready* when its frontier has
--                  reached the boundary its last warm-up counted from (claimed >=
--                  exact_from - 1): its entries hold every sighting its reader relies on.
--   x:<partition>  sorted set of the cross-partition decisions made in this group, scored
--                  by offset (member = offset * 4 + 1), until their pins are durable
--   holds          (group 0) field = partition, value = the record time (s) of a reader
--                  lagging the wall clock: the sweeper keeps what it may still need
--
-- Everything a call does is atomic, so two members (a zombie and the new owner of a
-- partition, or two partitions carrying copies of one click) never interleave inside it.

local CHAIN = '>HI6I4'
local CHAIN_SIZE = 12
local LONG = '>HBI6I4I4'
local LONG_SIZE = 17
local FRONTIER = '>I6I4I6'
local CLAIM = '>I4c11HI6I4I4B'
local CLAIM_SIZE = 32
local EXPECT = '>HI6'
local EXPECT_SIZE = 8
local COUNTED = 32768
local LONG_BIT = 16384
-- An item's start: what its first sighting was.
local COUNTS, CROSS, DUP = 0, 1, 2

-- Items as tables: p, counted, first, seen, start, ahead (boolean), reach. A chain's
-- reach is its latest sighting, whatever its bytes say: every sighting extends it
-- (`decide` moves `seen` only), and the sweeper must forget it `W + max_record_lag`
-- after the last one, not the first (issue 35: a click retried for longer than that
-- counted again).
local function chains_of(v)
  local chains = {}
  if v then
    local j = 1
    while j <= #v do
      local pc = struct.unpack('>H', v, j)
      local c
      if pc % COUNTED >= LONG_BIT then
        local _, flags, first, seen, reach = struct.unpack(LONG, v, j)
        local ahead = flags >= 4
        c = {p = pc % LONG_BIT, counted = pc >= COUNTED, first = first, seen = seen,
             start = flags % 4, ahead = ahead, reach = ahead and reach or seen}
        j = j + LONG_SIZE
      else
        local _, first, seen = struct.unpack(CHAIN, v, j)
        c = {p = pc % COUNTED, counted = pc >= COUNTED, first = first, seen = seen,
             start = pc >= COUNTED and COUNTS or CROSS, ahead = false, reach = seen}
        j = j + CHAIN_SIZE
      end
      chains[#chains + 1] = c
    end
  end
  return chains
end

local function pack(chains)
  local parts = {}
  for j, c in ipairs(chains) do
    local pc = c.p
    if c.counted then pc = pc + COUNTED end
    -- A plain chain (its start counted, or a copy that did not) keeps the short form.
    if not c.ahead and c.start ~= DUP then
      parts[j] = struct.pack(CHAIN, pc, c.first, c.seen)
    else
      local flags = c.start
      if c.ahead then flags = flags + 4 end
      parts[j] = struct.pack(LONG, pc + LONG_BIT, flags, c.first, c.seen, c.ahead and c.reach or c.seen)
    end
  end
  return table.concat(parts)
end

-- Whether this group still holds the cross-partition decision its first claim of `o`
-- made (until the flush that records it durably is committed).
local function cached_pin(xkey, o)
  return xkey ~= nil and redis.call('ZSCORE', xkey, o * 4 + 1) ~= false
end

-- The answer to a caller whose namespace is gone: what the group holds instead.
local function lost(why, detail)
  return {'LOST', '', why .. ':' .. (detail or ''), ''}
end

-- The verdict of an item's first sighting, read again.
local function start_again(c, pinned, uncounted, xkey, o)
  if pinned then return uncounted and 'd' or 'X'
  elseif c.start == COUNTS then return 'O'
  elseif c.start == DUP then return c.counted and 'D' or 'd'
  elseif cached_pin(xkey, o) then return 'X'
  else return 'U' end
end

-- Whether a fresh sighting at record time `clock` (partition clock `now` after it) lies
-- within the window after item `c`: a chain's latest sighting, or a sighting judged
-- ahead while the clock is within the window of its reach.
local function matches(c, clock, now, window)
  if not c.ahead then return clock - c.seen <= window end
  return c.seen <= clock and clock - c.seen <= window and now - window <= c.reach
end

-- A fresh sighting whose verdict depends on other partitions' chains (it would start
-- a chain): `blocked(p)` says whether a partition other than `p` is not ready, in which case
-- the claim waits ('W') and changes nothing. `clock > now`: the sighting is judged ahead
-- of its partition's clock, and is kept as an item of its own.
--
-- Returns the verdict byte, or nil when it must wait.
local function decide(key, field, v, p, o, clock, now, reread, exact, pinned, uncounted, warm, window, xkey, blocked)
  local chains = chains_of(v)
  local mine = nil
  for j, c in ipairs(chains) do
    if c.p == p and not c.ahead then mine = j end
  end
  if reread then
    if o < exact then return 'U' end
    for _, c in ipairs(chains) do
      if c.p == p and c.ahead and c.first == o then return start_again(c, pinned, uncounted, xkey, o) end
    end
    local c = mine and chains[mine]
    if not c then return 'U'
    elseif pinned then return uncounted and 'd' or 'X'
    elseif o == c.first then return start_again(c, pinned, uncounted, xkey, o)
    elseif o > c.first then return c.counted and 'D' or 'd'
    elseif cached_pin(xkey, o) then return 'X'
    else return 'U' end
  end
  local ahead = clock > now
  local in_chain = mine and matches(chains[mine], clock, now, window)
  local matched, counted = in_chain, in_chain and chains[mine].counted
  for _, c in ipairs(chains) do
    if c.p == p and c.ahead and matches(c, clock, now, window) then
      matched = true
      if c.counted then counted = true end
    end
  end
  if matched then
    local item = {p = p, counted = counted, first = o, seen = clock, start = DUP, ahead = false, reach = clock}
    if ahead then
      item.ahead, item.reach = true, now
      chains[#chains + 1] = item
    elseif in_chain then
      local c = chains[mine]
      if clock <= c.seen then
        if pinned then return uncounted and 'd' or 'X' end
        return counted and 'D' or 'd'
      end
      c.seen = clock
    elseif mine then
      chains[mine] = item
    else
      chains[#chains + 1] = item
    end
    redis.call('HSET', key, field, pack(chains))
    if pinned then return uncounted and 'd' or 'X' end
    return counted and 'D' or 'd'
  end
  local cross = pinned
  if not pinned and not warm then
    if blocked(p) then return nil end
    for _, c in ipairs(chains) do
      local gap = clock - c.seen
      if gap < 0 then gap = -gap end
      if c.p ~= p and c.counted and gap <= window then cross = true end
    end
  end
  local c = {p = p, counted = not cross, first = o, seen = clock, start = cross and CROSS or COUNTS,
             ahead = ahead, reach = ahead and now or clock}
  if ahead or not mine then chains[#chains + 1] = c else chains[mine] = c end
  redis.call('HSET', key, field, pack(chains))
  if not cross then return 'F' end
  if pinned then return uncounted and 'd' or 'X' end
  redis.call('ZADD', xkey, o, o * 4 + 1)
  return 'X'
end

-- The record after the sighting judged ahead at offset `o` confirmed its jump: that
-- sighting reaches from the clock `now` on.
local function confirm(key, field, p, o, now)
  local v = redis.call('HGET', key, field)
  if not v then return end
  local chains = chains_of(v)
  for _, c in ipairs(chains) do
    if c.p == p and c.ahead and c.first == o and now > c.reach then
      c.reach = now
      redis.call('HSET', key, field, pack(chains))
      return
    end
  end
end

-- KEYS[1] = the group's namespace key, KEYS[2] = the namespace's frontier hash,
-- KEYS[3 .. m+2] = the x sorted sets of the partitions named in ARGV[4], KEYS[m+3 ..]
-- = shard hashes.
-- ARGV[1] = the namespace the caller uses; ARGV[2] = the window (s); ARGV[3] = claims
--   packed back to back, each: key index into KEYS (u32, 1-based), field (11 bytes),
--   partition (u16), offset (u48), record time (u32, s), the partition's clock just after
--   the record (u32, s: below the record time for a sighting judged ahead of the clock),
--   mode (u8: bit 0 = pinned at its first read, bit 1 = a warm-up sighting, decided
--   within its partition, bit 2 = the pin is 'd', not 'X', bit 3 = not a sighting but a
--   confirmation: the sighting judged ahead at this offset reaches from the clock given
--   on; answered 'F', not used); ARGV[4] = the partitions of KEYS[3 .. m+2], comma-separated;
--   ARGV[5] = the marks, packed back to back, each '>HI6I4': a partition of the poll
--   batch, its highest offset read in the batch (claimed in any group, or a record that
--   is no click) and that record's
--   time. The frontier of a marked partition moves to its mark (for one with a claim
--   that waited in this call: to just before that claim); the claims of this call
--   lie at or below it. ARGV[6] = what the caller relies on the group holding, packed
--   '>HI6': a partition and one past the highest offset of it the caller saw
--   acknowledged (0 for a partition it reads through the cache but saw nothing of
--   acknowledged yet: its frontier must exist, written by the `restart` that planned
--   its reader); a frontier behind that, or missing, means the group lost writes (a
--   failover to a replica that lacked them, keys deleted while the member rebuilt).
--   ARGV[7] = the topic's partition count: a fresh sighting is decided only while every
--   other partition is ready.
--   ARGV[8] = where the caller's previous call left each partition of this one, packed
--   '>HI6': the partition and the mark that call sent. A member sends a poll batch's
--   call before the previous one is answered; if that one did not reach its mark here
--   (a sighting of it waited, or it failed), nothing of the partition is applied in
--   this call: its claims answer 'W' and its mark is not taken, as if they waited.
--
-- Claiming again what was claimed before (a retry after a reply was lost, a crash
-- between the calls of one batch) answers what the first claim answered: the counted
-- record 'O', a later sighting 'D', a cross-partition duplicate 'X' (from the sorted set
-- x:<partition>, where the first claim put it). Nothing changes in the cache.
--
-- Returns {'OK', verdicts, unready, refused} with one verdict byte per claim (`refused`:
-- the partitions whose previous call had not reached its mark here, comma-separated):
--   F first in its partition within the window (counts)    O the counted record, re-read
--   D an earlier sighting in its partition within the window
--   d the same, in a chain whose start did not count (an X): pinned like an X, so that a
--     warm-up starting after the chain's start rebuilds it as one that did not count
--   X a copy of a click counted on another partition within the window (does not count)
--   U a re-read the cache cannot decide (the reader rebuilds its state from the log)
--   W a fresh sighting while another partition is not ready (its state is being rebuilt):
--     nothing of it, nor of the partition's later claims in this call, was applied, and
--     the partition's frontier stops just before it; `unready` lists those partitions
-- or {'LOST', '', why:detail} when the caller's namespace is not this group's, or the
-- group lost writes the caller relied on; nothing was changed then.
local function claim(keys, args)
  local call, unpack_, pack_ = redis.call, struct.unpack, struct.pack
  local ns = call('GET', keys[1])
  if ns ~= args[1] then return lost('namespace', ns or '') end
  local fkey = keys[2]
  local window = tonumber(args[2])
  local blob = args[3]
  local xkeys = {}
  local m = 0
  for p in string.gmatch(args[4], '%d+') do
    m = m + 1
    xkeys[tonumber(p)] = keys[m + 2]
  end
  local frontier = {}   -- partition -> highest offset claimed before this claim
  local exact = {}      -- partition -> first offset a re-read can be decided at
  local touched = {}    -- partition -> record time at its new frontier
  local function load(p)
    local f = frontier[p]
    if f == nil then
      local v = call('HGET', fkey, p)
      if v then
        local _
        f, _, exact[p] = unpack_(FRONTIER, v)
        f = f - 1
      else
        f, exact[p] = -1, 0
      end
      frontier[p] = f
    end
    return f
  end
  local expect = args[6] or ''
  for j = 1, #expect, EXPECT_SIZE do
    local p, need = unpack_(EXPECT, expect, j)
    local v = call('HGET', fkey, p)
    if not v or unpack_(FRONTIER, v) < need then return lost('frontier', tostring(p)) end
  end
  local total = tonumber(args[7]) or 0
  local unready = nil
  local function unready_list()
    if unready == nil then
      unready = {}
      local ready = {}
      local all = call('HGETALL', fkey)
      for j = 1, #all, 2 do
        local next_, _, ex = unpack_(FRONTIER, all[j + 1])
        if next_ >= ex then ready[tonumber(all[j])] = true end
      end
      for q = 0, total - 1 do
        if not ready[q] then unready[#unready + 1] = q end
      end
    end
    return unready
  end
  -- Whether a partition other than `p` is not ready. Defined once, not per claim: the
  -- loop below runs for every click, and a closure per claim is garbage to collect.
  local function blocked_for(p)
    for _, q in ipairs(unready_list()) do
      if q ~= p then return true end
    end
    return false
  end
  local waiting = {}    -- partition -> the offset of its first claim that had to wait
  local prev = args[8] or ''
  for j = 1, #prev, EXPECT_SIZE do
    local p, mark = unpack_(EXPECT, prev, j)
    -- -1: before every claim and mark of the partition in this call.
    if load(p) < mark then waiting[p] = -1 end
  end
  local out = {}
  for i = 0, #blob / CLAIM_SIZE - 1 do
    local ki, field, p, o, clock, now, mode = unpack_(CLAIM, blob, i * CLAIM_SIZE + 1)
    local pinned = mode % 2 == 1
    local warm = mode % 4 >= 2
    local uncounted = mode % 8 >= 4
    local confirming = mode >= 8
    local f = frontier[p]
    if f == nil then f = load(p) end
    local key = keys[ki]
    local reread = o <= f
    -- Judged ahead of its partition's clock: never a plain chain (`decide`).
    local plain = clock <= now
    local verdict
    if waiting[p] then
      verdict = nil
    elseif confirming then
      -- Not a sighting: it moves no frontier, and its verdict is not used.
      confirm(key, field, p, o, now)
      verdict = 'F'
      o = f
    -- The common case first, in one scan of the hash: a click nobody has sighted.
    elseif plain and not reread and not pinned and (warm or not blocked_for(p))
        and call('HSETNX', key, field, pack_(CHAIN, p + COUNTED, o, clock)) == 1 then
      verdict = 'F'
    else
      local v = call('HGET', key, field)
      local single = v and #v == CHAIN_SIZE
      local pc, first, seen
      if single then pc, first, seen = unpack_(CHAIN, v) end
      if single and plain and pc % COUNTED == p then
        -- The other common case: the click sighted in this partition only.
        if reread then
          if o < exact[p] then verdict = 'U'
          elseif pinned then verdict = uncounted and 'd' or 'X'
          elseif o == first and pc >= COUNTED then verdict = 'O'
          elseif o > first then verdict = pc >= COUNTED and 'D' or 'd'
          elseif cached_pin(xkeys[p], o) then verdict = 'X'
          else verdict = 'U' end
        elseif clock - seen <= window then
          if clock > seen then call('HSET', key, field, pack_(CHAIN, pc, first, clock)) end
          if pinned then verdict = uncounted and 'd' or 'X'
          elseif pc >= COUNTED then verdict = 'D'
          else verdict = 'd' end
        elseif pinned then
          call('HSET', key, field, pack_(CHAIN, p, o, clock))
          verdict = uncounted and 'd' or 'X'
        elseif not warm and blocked_for(p) then
          verdict = nil
        else
          call('HSET', key, field, pack_(CHAIN, p + COUNTED, o, clock))
          verdict = 'F'
        end
      else
        verdict = decide(key, field, v, p, o, clock, now, reread, exact[p], pinned, uncounted, warm, window, xkeys[p], blocked_for)
      end
    end
    if verdict == nil then
      if not waiting[p] then waiting[p] = o end
      out[i + 1] = 'W'
    else
      out[i + 1] = verdict
      if o > f then
        frontier[p] = o
        touched[p] = now
      else
        frontier[p] = f
      end
    end
  end
  -- A partition whose claim waited here reaches its mark only up to just before that
  -- claim: everything of it before is decided (in this group or in its own), so the end
  -- of a warm-up in the same poll batch still makes it ready here.
  local marks = args[5] or ''
  for j = 1, #marks, CHAIN_SIZE do
    local p, o, clock = unpack_(CHAIN, marks, j)
    if waiting[p] and o >= waiting[p] then
      o = waiting[p] - 1
      clock = touched[p] or 0
    end
    if o > load(p) then
      frontier[p] = o
      if waiting[p] and touched[p] == nil then
        local v = call('HGET', fkey, p)
        if v then local _; _, clock = unpack_(FRONTIER, v) end
      end
      touched[p] = clock
    end
  end
  for p, clock in pairs(touched) do
    call('HSET', fkey, p, pack_(FRONTIER, frontier[p] + 1, clock, exact[p]))
  end
  local named, refused = '', {}
  for p, w in pairs(waiting) do
    if w == -1 then refused[#refused + 1] = p end
  end
  if next(waiting) ~= nil then named = table.concat(unready_list(), ',') end
  return {'OK', table.concat(out), named, table.concat(refused, ',')}
end

-- KEYS[1] = the group's frontier hash, KEYS[2 ..] = shard hashes of the group;
-- ARGV[1] = cutoff (s). Drops the items whose reach lies before the cutoff (a chain's
-- latest sighting, whether it starts with a count, a copy or a duplicate; for a
-- sighting judged ahead, the clock it was read at or confirmed to: no reader can need
-- them, see `SharedCache::sweep`), and entries left with none;
-- returns how many items went. A sighting judged ahead of no clock (reach 0: its
-- partition's first timestamped records) stays while the partition's frontier has no
-- clock: the record that may confirm it is still to come (decide.rs,
-- `Chain::kept_by_sweep`).
local function sweep(keys, args)
  local cutoff = tonumber(args[1])
  local removed = 0
  local clocks = nil   -- partition -> record time at its frontier, read once if needed
  local function unclocked(p)
    if clocks == nil then
      clocks = {}
      local all = redis.call('HGETALL', keys[1])
      for j = 1, #all, 2 do
        local _, clock = struct.unpack(FRONTIER, all[j + 1])
        clocks[tonumber(all[j])] = clock
      end
    end
    local clock = clocks[p]
    return clock == nil or clock == 0
  end
  for k = 2, #keys do
    local key = keys[k]
    local all = redis.call('HGETALL', key)
    local gone = {}
    for j = 1, #all, 2 do
      local chains = chains_of(all[j + 1])
      local kept = {}
      for _, c in ipairs(chains) do
        if c.reach >= cutoff or (c.ahead and c.reach == 0 and unclocked(c.p)) then kept[#kept + 1] = c end
      end
      if #kept < #chains then
        removed = removed + #chains - #kept
        if #kept == 0 then
          gone[#gone + 1] = all[j]
        else
          redis.call('HSET', key, all[j], pack(kept))
        end
      end
    end
    if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  end
  return removed
end

-- KEYS[1] = the group's namespace key, KEYS[2] = the namespace's frontier hash;
-- ARGV = the namespace, partition, lookback, boundary. Before a reader counts from
-- `boundary` after a warm-up from `lookback`: unless the frontier is already past the
-- lookback, what lies before the lookback is unknown, so re-reads are exact only from
-- the boundary on, and the partition is not ready until the warm-up reaches it. A
-- frontier at or past the lookback but short of the boundary keeps what it claimed,
-- but the partition is not ready either until the warm-up reaches the boundary (nobody
-- decided what lies between: offsets moved forward, a zombie committed past it), and
-- re-reads below the boundary are no longer exact. A partition the namespace never saw
-- gets its frontier here, so that others know it.
-- Returns 1 when it restarted the partition, 0 when the cache was past the lookback,
-- or the LOST answer of `claim`.
local function restart(keys, args)
  local ns = redis.call('GET', keys[1])
  if ns ~= args[1] then return lost('namespace', ns or '') end
  local p, lookback, boundary = args[2], tonumber(args[3]), tonumber(args[4])
  local v = redis.call('HGET', keys[2], p)
  if v then
    local next_, clock, ex = struct.unpack(FRONTIER, v)
    if next_ >= lookback then
      if next_ < boundary and ex < boundary then
        redis.call('HSET', keys[2], p, struct.pack(FRONTIER, next_, clock, boundary))
      end
      return 0
    end
  end
  redis.call('HSET', keys[2], p, struct.pack(FRONTIER, lookback, 0, boundary))
  return 1
end

-- KEYS[1] = a group's namespace key; ARGV[1] = a new name. The group's namespace,
-- set to the new name if it has none.
local function open(keys, args)
  local ns = redis.call('GET', keys[1])
  if ns then return ns end
  redis.call('SET', keys[1], args[1])
  return args[1]
end

-- KEYS[1] = a group's namespace key, KEYS[2] = where the previous name is kept (for the
-- sweeper to delete its keys); ARGV[1] = the namespace found lost, ARGV[2] = a new
-- name. Moves the group to the new name unless another member already moved it;
-- returns the group's namespace.
local function renew(keys, args)
  local ns = redis.call('GET', keys[1])
  if ns and ns ~= args[1] then return ns end
  redis.call('SET', keys[1], args[2])
  if args[1] ~= '' then redis.call('SET', keys[2], args[1]) end
  return args[2]
end

redis.register_function('clickagg_claim_v1', claim)
redis.register_function('clickagg_sweep_v1', sweep)
redis.register_function('clickagg_restart_v1', restart)
redis.register_function('clickagg_open_v1', open)
redis.register_function('clickagg_renew_v1', renew)
