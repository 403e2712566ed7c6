-- gateway.metrics: per-source request counters and latency histograms, in Prometheus' text format.
--
--   record(broken)  log_by_lua of the public server (via gateway.handler.log): one request into the
--                   counters; broken: the model server cut its stream off (gateway.handler.body_filter)
--   expose()   content_by_lua of `location = /metrics` on the metrics listener (conf/metrics.conf)
--
-- What is counted, per request (except /healthz, which compose polls):
--   gateway_requests_total{source, code}             requests by caller source and HTTP status
--   gateway_request_duration_seconds{source}         histogram of nginx's $request_time (first byte
--                                                    read to last byte sent; a stream's whole length)
--   gateway_upstream_first_byte_seconds{source}      histogram of $upstream_header_time (vLLM's answer
--                                                    head, i.e. time to first token for a stream); only
--                                                    requests that reached vLLM
-- and per model server (several UPSTREAMS, docs/scale-out.md), one count per try nginx made:
--   gateway_upstream_requests_total{upstream, code}  tries by server address (ip:port as nginx resolved
--                                                    it) and that try's status (502: no connection)
--   gateway_upstream_response_seconds{upstream}      histogram of each try's $upstream_response_time
--   gateway_upstream_stream_errors_total{upstream}   streams the server cut off mid-answer
-- `source` is the key's source name from the keys file, never the key or its fingerprint. Requests
-- without a known key get "anonymous" (no key sent, or a path outside /v1/) or "rejected" (a key that
-- is not in the file). Labels therefore stay a small, fixed set: the sources, two names, the statuses.
--
-- Numbers live in the lua_shared_dict `gateway_metrics` (conf/http.conf): every worker adds to the same
-- counters and they survive `nginx -s reload`. A histogram stores one count per bucket (not cumulative)
-- and the exposition adds them up, so the +Inf bucket and _count are the same number by construction
-- even while other workers write. Dict keys (source names cannot hold "|" or spaces, see gateway.keys):
--   n|<source>|<code>               request count
--   h|<metric>|<source>|<i>         observations in bucket i (i = #BUCKETS + 1 is above the last bound)
--   s|<metric>|<source>             sum of the observations
--   u|<upstream>|<code>             tries per model server (histogram "r" is keyed by upstream too)
--   b|<upstream>                    streams cut off by that server

local ngx = ngx
local format, match, gmatch, gsub, concat, sort =
    string.format, string.match, string.gmatch, string.gsub, table.concat, table.sort
local tonumber, pairs, ipairs = tonumber, pairs, ipairs

local M = {}

-- Seconds. From a fast refusal (a 401 is well under 5 ms) to an hour-long stream (proxy_read_timeout).
local BUCKETS = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600}
M.BUCKETS = BUCKETS

local HISTOGRAMS = {
    {short = "d", name = "gateway_request_duration_seconds",
     help = "Time from the request's first byte to the response's last byte, by caller source."},
    {short = "f", name = "gateway_upstream_first_byte_seconds",
     help = "Time until the model server's response head arrived (time to first token for streams), "
         .. "by caller source; requests that reached the model server only."},
    {short = "r", name = "gateway_upstream_response_seconds", label = "upstream",
     help = "Time each try spent on a model server (connect to last byte), by server address."},
}
local COUNTER = {name = "gateway_requests_total",
                 help = "Requests through the gateway, by caller source and HTTP status code."}
local UPSTREAM_COUNTER = {name = "gateway_upstream_requests_total",
                          help = "Tries on each model server, by server address and that try's HTTP "
                              .. "status (502: no connection)."}
local BROKEN_COUNTER = {name = "gateway_upstream_stream_errors_total",
                        help = "Streams a model server cut off in the middle of the answer, by server address."}

local function dict()
    return ngx.shared.gateway_metrics
end

local function bucket_index(value)
    for i = 1, #BUCKETS do
        if value <= BUCKETS[i] then
            return i
        end
    end
    return #BUCKETS + 1
end

local function observe(d, short, source, value)
    d:incr("h|" .. short .. "|" .. source .. "|" .. bucket_index(value), 1, 0)
    d:incr("s|" .. short .. "|" .. source, value, 0)
end

-- nginx lists one entry per try, ", " between tries and " : " between internal redirects:
-- "10.0.0.2:8000, 10.0.0.3:8000". Returns the entries in order.
local function tries(text)
    local out = {}
    if not text or text == "" then
        return out
    end
    for item in gmatch((gsub(text, " : ", ", ")), "[^,]+") do
        out[#out + 1] = match(item, "^%s*(.-)%s*$")
    end
    return out
end

local function record_upstreams(d, var, broken)
    local addrs = tries(var.upstream_addr)
    local statuses = tries(var.upstream_status)
    local times = tries(var.upstream_response_time)
    for i, addr in ipairs(addrs) do
        local code = match(statuses[i] or "", "^%d+$") or "502"
        d:incr("u|" .. addr .. "|" .. code, 1, 0)
        local seconds = tonumber(times[i])
        if seconds then
            observe(d, "r", addr, seconds)
        end
    end
    local last = addrs[#addrs]
    if broken and last then
        d:incr("b|" .. last, 1, 0)
    end
end

function M.record(broken)
    local var = ngx.var
    if var.uri == "/healthz" then
        return
    end
    local d = dict()
    if not d then
        return
    end
    local source = var.gw_source
    if source == nil or source == "" or source == "-" then
        source = var.gw_error == "invalid_api_key" and "rejected" or "anonymous"
    end

    local _, err = d:incr("n|" .. source .. "|" .. var.status, 1, 0)
    if err then
        ngx.log(ngx.WARN, "gateway: metrics not recorded: ", err)
        return
    end
    local total = tonumber(var.request_time)
    if total then
        observe(d, "d", source, total)
    end
    -- "0.052", or "0.011, 0.052" when nginx tried more than once: the last try is the one answered.
    local first_byte = tonumber(match(var.upstream_header_time or "", "([%d.]+)%s*$"))
    if first_byte then
        observe(d, "f", source, first_byte)
    end
    record_upstreams(d, var, broken)
end

-- Label values: backslash, double quote and newline escaped as the exposition format wants. Source
-- names cannot hold any of them today; this keeps the output valid if that rule ever changes.
local function label(value)
    return (gsub(gsub(gsub(value, "\\", "\\\\"), '"', '\\"'), "\n", "\\n"))
end

local function le_text(bound)
    return format("%g", bound)
end

local function sorted_keys(t)
    local out = {}
    for k in pairs(t) do
        out[#out + 1] = k
    end
    sort(out)
    return out
end

-- The exposition text (Prometheus text format 0.0.4), families in a fixed order, series sorted.
function M.render()
    local d = dict()
    local counts = {}                      -- counts[source][code] = n
    local by_upstream = {}                 -- by_upstream[addr][code] = n
    local broken = {}                      -- broken[addr] = n
    local hist = {d = {}, f = {}, r = {}}  -- hist[short][source or addr] = {buckets = {i = n}, sum = x}
    for _, key in ipairs(d:get_keys(0)) do
        local value = d:get(key)
        if value then
            local kind, rest = match(key, "^(%a)|(.*)$")
            if kind == "n" or kind == "u" then
                local name, code = match(rest, "^(.+)|(%d+)$")
                local into = kind == "n" and counts or by_upstream
                if name then
                    into[name] = into[name] or {}
                    into[name][code] = value
                end
            elseif kind == "b" then
                broken[rest] = value
            elseif kind == "h" or kind == "s" then
                local short, source, i
                if kind == "h" then
                    short, source, i = match(rest, "^(%a)|(.+)|(%d+)$")
                else
                    short, source = match(rest, "^(%a)|(.+)$")
                end
                local by_source = short and hist[short]
                if by_source and source then
                    local h = by_source[source] or {buckets = {}, sum = 0}
                    by_source[source] = h
                    if kind == "h" then
                        h.buckets[tonumber(i)] = value
                    else
                        h.sum = value
                    end
                end
            end
        end
    end

    local out = {}
    local function line(text)
        out[#out + 1] = text
    end

    local function counter(family, label_name, values)
        line("# HELP " .. family.name .. " " .. family.help)
        line("# TYPE " .. family.name .. " counter")
        for _, name in ipairs(sorted_keys(values)) do
            local by_code = values[name]
            for _, code in ipairs(sorted_keys(by_code)) do
                line(format('%s{%s="%s",code="%s"} %d', family.name, label_name, label(name), code, by_code[code]))
            end
        end
    end
    counter(COUNTER, "source", counts)
    counter(UPSTREAM_COUNTER, "upstream", by_upstream)
    line("# HELP " .. BROKEN_COUNTER.name .. " " .. BROKEN_COUNTER.help)
    line("# TYPE " .. BROKEN_COUNTER.name .. " counter")
    -- Every server that had a try gets a series, 0 until a stream breaks: a rate() over it then starts
    -- from a known zero instead of appearing only at the first failure.
    for addr in pairs(by_upstream) do
        broken[addr] = broken[addr] or 0
    end
    for _, addr in ipairs(sorted_keys(broken)) do
        line(format('%s{upstream="%s"} %d', BROKEN_COUNTER.name, label(addr), broken[addr]))
    end

    for _, family in ipairs(HISTOGRAMS) do
        local name = family.name
        line("# HELP " .. name .. " " .. family.help)
        line("# TYPE " .. name .. " histogram")
        local by_source = hist[family.short]
        local key = family.label or "source"
        for _, source in ipairs(sorted_keys(by_source)) do
            local h = by_source[source]
            local src = label(source)
            local cumulative = 0
            for i = 1, #BUCKETS do
                cumulative = cumulative + (h.buckets[i] or 0)
                line(format('%s_bucket{%s="%s",le="%s"} %d', name, key, src, le_text(BUCKETS[i]), cumulative))
            end
            cumulative = cumulative + (h.buckets[#BUCKETS + 1] or 0)
            line(format('%s_bucket{%s="%s",le="+Inf"} %d', name, key, src, cumulative))
            line(format('%s_sum{%s="%s"} %.6f', name, key, src, h.sum))
            line(format('%s_count{%s="%s"} %d', name, key, src, cumulative))
        end
    end
    return concat(out, "\n") .. "\n"
end

function M.expose()
    if ngx.req.get_method() ~= "GET" and ngx.req.get_method() ~= "HEAD" then
        ngx.status = 405
        ngx.header["Allow"] = "GET, HEAD"
        return ngx.exit(405)
    end
    ngx.header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
    ngx.header["Cache-Control"] = "no-store"
    ngx.print(M.render())
end

return M
