-- gateway.limits: per-key request-rate and in-flight limits, shared by all nginx workers.
--
-- Counters live in the lua_shared_dict `gateway_limits` (declared in conf/http.conf) so every worker
-- sees the same numbers, and they survive `nginx -s reload` (a dict keeps its contents across reloads
-- when its name and size are unchanged). Keys are counted by fingerprint, never by the key itself.
--
-- rpm: a sliding window over two fixed one-minute windows (the previous window's count weighted by how
-- much of it still overlaps the last 60 s). It needs no lock: one incr and one get per request.
-- concurrent: a counter taken in the access phase and given back when the response's last byte leaves
-- (body filter) or, for requests that never got there (client aborts), in the log phase.

local ngx = ngx
local floor, ceil, max = math.floor, math.ceil, math.max

local M = {}

local WINDOW = 60

local function dict()
    return ngx.shared.gateway_limits
end

-- take_rate(id, rpm) -> true, or false and the seconds to wait before a retry can succeed.
function M.take_rate(id, rpm)
    local d = dict()
    local now = ngx.now()
    local window = floor(now / WINDOW)
    local elapsed = now - window * WINDOW
    local current = d:incr("r:" .. id .. ":" .. window, 1, 0, 2 * WINDOW)
    local previous = d:get("r:" .. id .. ":" .. (window - 1)) or 0
    local weight = (WINDOW - elapsed) / WINDOW
    if previous * weight + current <= rpm then
        return true
    end
    -- Refused requests do not count against the caller.
    d:incr("r:" .. id .. ":" .. window, -1)
    current = current - 1
    -- Wait until the weighted estimate leaves room for one more request, or the window ends.
    local wait
    if current + 1 > rpm or previous == 0 then
        wait = WINDOW - elapsed
    else
        -- previous * (WINDOW - elapsed - t) / WINDOW + current + 1 <= rpm
        wait = (WINDOW - elapsed) - (rpm - current - 1) * WINDOW / previous
    end
    return false, max(1, ceil(wait))
end

-- take_slot(id, limit) -> true if the key had fewer than `limit` requests in flight.
function M.take_slot(id, limit)
    local d = dict()
    local n = d:incr("c:" .. id, 1, 0)
    if n <= limit then
        return true
    end
    d:incr("c:" .. id, -1)
    return false
end

function M.release_slot(id)
    local d = dict()
    local n = d:incr("c:" .. id, -1, 0)
    if n and n < 0 then
        -- Only possible if the dict was flushed under us; never let the count drift negative.
        d:set("c:" .. id, 0)
    end
end

return M
