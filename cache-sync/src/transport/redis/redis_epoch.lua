-- The stream's epoch (see EPOCH in redis.rs): the one in KEYS[3], else the
-- one its newest entry carries (a stream that lives on keeps its epoch),
-- else a new one from the server's clock, in microseconds. Stored in KEYS[3].
local function stream_epoch()
  local epoch = redis.call('GET', KEYS[3])
  if epoch then return epoch end
  local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
  if newest then
    local f = newest[2]
    for i = 1, #f, 2 do
      if f[i] == 'e' then epoch = f[i + 1] break end
    end
  end
  if not epoch then
    local t = redis.call('TIME')
    epoch = t[1] .. string.format('%06d', t[2])
  end
  redis.call('SET', KEYS[3], epoch)
  return epoch
end
