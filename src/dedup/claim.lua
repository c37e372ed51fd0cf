#!lua name=clickagg_dedup_v1
--
-- The dedup cache's only writer. src/dedup/mod.rs states the definition; decide.rs
-- holds this same logic in Rust (`decide_shared`), where the property test checks it.
--
-- Keys come in groups (one group per Redis Cluster hash tag; a single Redis has one),
-- and every call touches one group only (a Redis Cluster runs a function only on keys
-- of one slot):
--   shard hashes   field = a fingerprint's low 88 bits (11 bytes); value = one 12-byte
--                  chain per partition that sighted the click, '>HI6I4': the partition
--                  (bit 15 set when the chain counted), the offset where the chain
--                  started, and the record time (s) of its latest sighting
--   frontier       field = partition, value = '>I6I4I6': the highest offset of that
--                  partition claimed through this group, its record time, and the offset
--                  from which the entries are exact for re-reads (a warm-up that rebuilt
--                  lost state makes them exact from the boundary it counted from); a claim
--                  at or below the highest offset is a re-read, which never changes an
--                  entry. "Claimed through": the client sends every group the highest
--                  offset of each partition in the poll batch (a mark), also groups that
--                  got none of its clicks, so all groups' frontiers agree once every call
--                  of a batch succeeded; a group whose frontier is behind the others (a
--                  crash between the calls) or missing (a node that lost its data) shows
--                  the client where the cache is incomplete.
--   x:<partition>  sorted set of the cross-partition decisions made in this group, scored
--                  by offset (member = offset * 4 + 1), until their pins are durable
--
-- Everything a call does is atomic, so two members (a zombie and the new owner of a
-- partition, or two partitions carrying copies of one click) never interleave inside it.

local CHAIN = '>HI6I4'
local CHAIN_SIZE = 12
local FRONTIER = '>I6I4I6'
local CLAIM = '>Hc11HI6I4B'
local CLAIM_SIZE = 26
local COUNTED = 32768

local function chains_of(v)
  local chains = {}
  if v then
    for j = 1, #v, CHAIN_SIZE do
      local pc, first, seen = struct.unpack(CHAIN, v, j)
      chains[#chains + 1] = {p = pc % COUNTED, counted = pc >= COUNTED, first = first, seen = seen}
    end
  end
  return chains
end

local function pack(chains)
  local parts = {}
  for j, c in ipairs(chains) do
    local pc = c.p
    if c.counted then pc = pc + COUNTED end
    parts[j] = struct.pack(CHAIN, pc, c.first, c.seen)
  end
  return table.concat(parts)
end

-- Whether this group still holds the cross-partition decision its first claim of `o`
-- made (until the flush that records it durably is committed).
local function cached_pin(xkey, o)
  return xkey ~= nil and redis.call('ZSCORE', xkey, o * 4 + 1) ~= false
end

-- KEYS[1] = the group's frontier hash, KEYS[2 .. m+1] = the x sorted sets of the
-- partitions named in ARGV[3], KEYS[m+2 ..] = shard hashes.
-- ARGV[1] = the window (s); ARGV[2] = claims packed back to back, each: key index into
--   KEYS (u16, 1-based), field (11 bytes), partition (u16), offset (u48), record time
--   (u32, s), mode (u8: bit 0 = pinned as a cross-partition duplicate at its first read,
--   bit 1 = a warm-up sighting, decided within its partition); ARGV[3] = the partitions
--   of KEYS[2 .. m+1], comma-separated; ARGV[4] = the marks, packed back to back, each
--   '>HI6I4': a partition of the poll batch, its highest offset claimed in the batch (in
--   any group) and that record's time. The frontier of a marked partition moves to its
--   mark; the claims of this call lie at or below it.
--
-- Claiming again what was claimed before (a retry after a reply was lost, a crash
-- between the calls of one batch) answers what the first claim answered: the counted
-- record 'O', a later sighting 'D', a cross-partition duplicate 'X' (from the sorted set
-- x:<partition>, where the first claim put it). Nothing changes in the cache.
-- Returns one verdict byte per claim:
--   F first in its partition within the window (counts)    O the counted record, re-read
--   D an earlier sighting in its partition within the window
--   X a copy of a click counted on another partition within the window (does not count)
--   U a re-read the cache cannot decide (the reader rebuilds its state from the log)
-- Any entry: several partitions' chains, or none (a re-read, or a pinned sighting).
local function decide(key, field, v, p, o, clock, reread, exact, pinned, warm, window, xkey)
  local chains = chains_of(v)
  local mine = nil
  for j, c in ipairs(chains) do
    if c.p == p then mine = j end
  end
  if reread then
    local c = mine and chains[mine]
    if o < exact or not c then return 'U'
    elseif pinned then return 'X'
    elseif o == c.first and c.counted then return 'O'
    elseif o > c.first then return 'D'
    elseif cached_pin(xkey, o) then return 'X'
    else return 'U' end
  end
  if mine and clock - chains[mine].seen <= window then
    local c = chains[mine]
    if clock > c.seen then
      c.seen = clock
      redis.call('HSET', key, field, pack(chains))
    end
    if pinned then return 'X' else return 'D' end
  end
  local cross = pinned
  if not pinned and not warm then
    for _, c in ipairs(chains) do
      local gap = clock - c.seen
      if gap < 0 then gap = -gap end
      if c.p ~= p and c.counted and gap <= window then cross = true end
    end
  end
  local c = {p = p, counted = not cross, first = o, seen = clock}
  if mine then chains[mine] = c else chains[#chains + 1] = c end
  redis.call('HSET', key, field, pack(chains))
  if not cross then return 'F' end
  if not pinned then redis.call('ZADD', xkey, o, o * 4 + 1) end
  return 'X'
end

local function claim(keys, args)
  local call, unpack_, pack_ = redis.call, struct.unpack, struct.pack
  local window = tonumber(args[1])
  local blob = args[2]
  local fkey = keys[1]
  local xkeys = {}
  local m = 0
  for p in string.gmatch(args[3], '%d+') do
    m = m + 1
    xkeys[tonumber(p)] = keys[m + 1]
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
      else
        f, exact[p] = -1, 0
      end
    end
    return f
  end
  local out = {}
  for i = 0, #blob / CLAIM_SIZE - 1 do
    local ki, field, p, o, clock, mode = unpack_(CLAIM, blob, i * CLAIM_SIZE + 1)
    local pinned = mode % 2 == 1
    local warm = mode >= 2
    local f = load(p)
    local key = keys[ki]
    local reread = o <= f
    local verdict
    -- The common case first, in one scan of the hash: a click nobody has sighted.
    if not reread and not pinned and call('HSETNX', key, field, pack_(CHAIN, p + COUNTED, o, clock)) == 1 then
      verdict = 'F'
    else
      local v = call('HGET', key, field)
      local single = v and #v == CHAIN_SIZE
      local pc, first, seen
      if single then pc, first, seen = unpack_(CHAIN, v) end
      if single and pc % COUNTED == p then
        -- The other common case: the click sighted in this partition only.
        if reread then
          if o < exact[p] then verdict = 'U'
          elseif pinned then verdict = 'X'
          elseif o == first and pc >= COUNTED then verdict = 'O'
          elseif o > first then verdict = 'D'
          elseif cached_pin(xkeys[p], o) then verdict = 'X'
          else verdict = 'U' end
        elseif clock - seen <= window then
          if clock > seen then call('HSET', key, field, pack_(CHAIN, pc, first, clock)) end
          if pinned then verdict = 'X' else verdict = 'D' end
        elseif pinned then
          call('HSET', key, field, pack_(CHAIN, p, o, clock))
          verdict = 'X'
        else
          call('HSET', key, field, pack_(CHAIN, p + COUNTED, o, clock))
          verdict = 'F'
        end
      else
        verdict = decide(key, field, v, p, o, clock, reread, exact[p], pinned, warm, window, xkeys[p])
      end
    end
    out[i + 1] = verdict
    if o > f then
      frontier[p] = o
      touched[p] = clock
    else
      frontier[p] = f
    end
  end
  local marks = args[4] or ''
  for j = 1, #marks, CHAIN_SIZE do
    local p, o, clock = unpack_(CHAIN, marks, j)
    if o > load(p) then
      frontier[p] = o
      touched[p] = clock
    end
  end
  for p, clock in pairs(touched) do
    call('HSET', fkey, p, pack_(FRONTIER, frontier[p], clock, exact[p]))
  end
  return table.concat(out)
end

-- KEYS = shard hashes of one group; ARGV[1] = cutoff (s). Drops the chains last seen
-- before the cutoff (no reader within the lag bound can need them), and entries left
-- with none; returns how many chains went.
local function sweep(keys, args)
  local cutoff = tonumber(args[1])
  local removed = 0
  for _, key in ipairs(keys) do
    local all = redis.call('HGETALL', key)
    local gone = {}
    for j = 1, #all, 2 do
      local chains = chains_of(all[j + 1])
      local kept = {}
      for _, c in ipairs(chains) do
        if c.seen >= cutoff then kept[#kept + 1] = c end
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

-- KEYS[1] = a group's frontier hash; ARGV = partition, lookback, boundary. Before a
-- warm-up that rebuilds a partition's lost state from its lookback: unless the frontier
-- is already past it, what lies before the lookback is unknown, so re-reads are exact
-- only from the boundary the warm-up counts from.
local function restart(keys, args)
  local p, lookback, boundary = args[1], tonumber(args[2]), tonumber(args[3])
  local v = redis.call('HGET', keys[1], p)
  if v then
    local f = struct.unpack(FRONTIER, v)
    if f >= lookback - 1 then return 0 end
  end
  redis.call('HSET', keys[1], p, struct.pack(FRONTIER, lookback - 1, 0, boundary))
  return 1
end

redis.register_function('clickagg_claim_v1', claim)
redis.register_function('clickagg_sweep_v1', sweep)
redis.register_function('clickagg_restart_v1', restart)
