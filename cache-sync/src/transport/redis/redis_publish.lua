-- cache-sync's Redis Streams publish; XADD_SCRIPT in redis.rs says why it
-- exists. It runs after redis_epoch.lua, which defines stream_epoch().
-- KEYS[1] the stream, KEYS[2] its ordinal counter, KEYS[3] its epoch;
-- ARGV[1] the approximate MAXLEN, ARGV[2] the tag, ARGV[3] the payload.
local epoch = stream_epoch()
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
