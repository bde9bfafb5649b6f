-- cache-sync's Redis Streams publish; XADD_SCRIPT in redis.rs says why it exists.
-- KEYS[1] the stream, KEYS[2] its ordinal counter, KEYS[3] its epoch;
-- ARGV[1] the approximate MAXLEN, ARGV[2] the tag, ARGV[3] the payload.
local epoch = redis.call('GET', KEYS[3])
if not epoch then
  -- A stream that lives on keeps the epoch its entries carry; a new one
  -- (or one that lost its history) gets a new epoch from the server clock.
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
  if last then
    local f = last[2]
    for i = 1, #f, 2 do
      if f[i] == 'e' then epoch = f[i + 1] break end
    end
  end
  if not epoch then
    local t = redis.call('TIME')
    epoch = t[1] .. string.format('%06d', t[2])
  end
  redis.call('SET', KEYS[3], epoch)
end
local n = redis.call('INCR', KEYS[2])
if n == 1 then
  local ok, info = pcall(redis.call, 'XINFO', 'STREAM', KEYS[1])
  if ok then
    for i = 1, #info, 2 do
      if info[i] == 'entries-added' then n = info[i + 1] + 1 break end
    end
    redis.call('SET', KEYS[2], n)
  end
end
local ok, id = pcall(redis.call, 'XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'n', n, 'e', epoch, 't', ARGV[2], 'p', ARGV[3])
if not ok then
  redis.call('DECR', KEYS[2])
  return redis.error_reply(id.err or tostring(id))
end
return id
