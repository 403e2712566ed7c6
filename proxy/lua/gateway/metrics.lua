-- gateway.metrics: per-source request counters and latency histograms, in Prometheus' text format.
--
--   record()   log_by_lua of the public server (via gateway.handler.log): one request into the counters
--   expose()   content_by_lua of `location = /metrics` on the metrics listener (conf/metrics.conf)
--
-- What is counted, per request (except /healthz, which compose polls):
--   gateway_requests_total{source, code}             requests by caller source and HTTP status
--   gateway_request_duration_seconds{source}         histogram of nginx's $request_time (first byte
--                                                    read to last byte sent; a stream's whole length)
--   gateway_upstream_first_byte_seconds{source}      histogram of $upstream_header_time (vLLM's answer
--                                                    head, i.e. time to first token for a stream); only
--                                                    requests that reached vLLM
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

local ngx = ngx
local format, match, gsub, concat, sort = string.format, string.match, string.gsub, table.concat, table.sort
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
}
local COUNTER = {name = "gateway_requests_total",
                 help = "Requests through the gateway, by caller source and HTTP status code."}

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

function M.record()
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
    local hist = {d = {}, f = {}}          -- hist[short][source] = {buckets = {i = n}, sum = x}
    for _, key in ipairs(d:get_keys(0)) do
        local value = d:get(key)
        if value then
            local kind, rest = match(key, "^(%a)|(.*)$")
            if kind == "n" then
                local source, code = match(rest, "^(.+)|(%d+)$")
                if source then
                    counts[source] = counts[source] or {}
                    counts[source][code] = value
                end
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

    line("# HELP " .. COUNTER.name .. " " .. COUNTER.help)
    line("# TYPE " .. COUNTER.name .. " counter")
    for _, source in ipairs(sorted_keys(counts)) do
        local by_code = counts[source]
        for _, code in ipairs(sorted_keys(by_code)) do
            line(format('%s{source="%s",code="%s"} %d', COUNTER.name, label(source), code, by_code[code]))
        end
    end

    for _, family in ipairs(HISTOGRAMS) do
        local name = family.name
        line("# HELP " .. name .. " " .. family.help)
        line("# TYPE " .. name .. " histogram")
        local by_source = hist[family.short]
        for _, source in ipairs(sorted_keys(by_source)) do
            local h = by_source[source]
            local src = label(source)
            local cumulative = 0
            for i = 1, #BUCKETS do
                cumulative = cumulative + (h.buckets[i] or 0)
                line(format('%s_bucket{source="%s",le="%s"} %d', name, src, le_text(BUCKETS[i]), cumulative))
            end
            cumulative = cumulative + (h.buckets[#BUCKETS + 1] or 0)
            line(format('%s_bucket{source="%s",le="+Inf"} %d', name, src, cumulative))
            line(format('%s_sum{source="%s"} %.6f', name, src, h.sum))
            line(format('%s_count{source="%s"} %d', name, src, cumulative))
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
