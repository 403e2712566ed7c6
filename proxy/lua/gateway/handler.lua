-- gateway.handler: the phase handlers that conf/http.conf and conf/server.conf call.
--
--   init()         init_by_lua (master, at start and at every reload): environment and keys file
--   access()       access_by_lua on /v1/: key -> source and priority, limits, body check and splice,
--                  the conversation's affinity key (which model server, when there are several)
--   body_filter()  body_filter_by_lua: gives back the in-flight slot as the last byte leaves; ends a
--                  stream the model server cut off with an error event
--   log()          log_by_lua (every request): gives it back if the body filter could not, and counts
--                  the request in gateway.metrics
--   upstream_error(status)  error_page for 502/503/504 that nginx itself produces
--   too_large()    error_page 413 (nginx's hard body-size ceiling)
--   internal_error()  error_page 500 (a fault in the gateway itself; the model server's 500s pass through)
--   not_found()    every path outside /v1/ and /healthz
--
-- State that must outlive an internal redirect (error_page) lives in nginx variables ($gw_*), not in
-- ngx.ctx, which nginx clears on redirects: the log phase must still know a slot was taken when the
-- upstream failed and the request ended in the 502 page.

local errors = require "gateway.errors"
local affinity = require "gateway.affinity"
local body = require "gateway.body"
local keys = require "gateway.keys"
local limits = require "gateway.limits"
local metrics = require "gateway.metrics"

local ngx = ngx
local match, tonumber, find = string.match, tonumber, string.find

local M = {}

-- Filled by init(); workers inherit them from the master.
local conf = {}
local by_key = {}

local BODY_METHODS = {POST = true, PUT = true, PATCH = true}
local ASK_FOR_KEY = {headers = {["WWW-Authenticate"] = "Bearer"}}

-- "32m", "100k", "1048576" -> bytes. Returns nil for anything else.
local function parse_size(text)
    local n, unit = match(text, "^%s*(%d+)%s*([kKmM]?)%s*$")
    if not n then
        return nil
    end
    local scale = ({[""] = 1, k = 1024, K = 1024, m = 1048576, M = 1048576})[unit]
    return tonumber(n) * scale
end

local function env_number(name, default, parse)
    local raw = os.getenv(name)
    if raw == nil or raw == "" then
        return default
    end
    local value = (parse or function(s) return match(s, "^%s*%d+%s*$") and tonumber(s) end)(raw)
    if not value then
        error(name .. " must be a non-negative integer" .. (parse and " (suffix k or m allowed)" or "")
            .. ", got '" .. raw .. "'", 0)
    end
    return value
end

function M.init()
    -- run-local.sh always sets PROXY_KEYS_FILE; the default is the keys file beside conf/ under nginx's prefix.
    conf.keys_file = os.getenv("PROXY_KEYS_FILE")
    if conf.keys_file == nil or conf.keys_file == "" then
        conf.keys_file = ngx.config.prefix() .. "conf/gateway/keys"
    end
    conf.max_body = env_number("PROXY_MAX_BODY_BYTES", 32 * 1048576, parse_size)
    local defaults = {
        rpm = env_number("PROXY_RPM", 0),
        concurrent = env_number("PROXY_CONCURRENT", 0),
    }
    local upstream_key = os.getenv("UPSTREAM_API_KEY")
    conf.upstream_auth = (upstream_key and upstream_key ~= "") and ("Bearer " .. upstream_key) or ""

    local loaded, err = keys.load(conf.keys_file, defaults)
    if not loaded then
        error(err, 0) -- fails the start, or the reload (nginx then keeps the old configuration)
    end
    by_key = loaded.by_key
    ngx.log(ngx.NOTICE, "gateway: ", loaded.count, " keys from ", conf.keys_file,
        "; max body ", conf.max_body, " bytes; default rpm ", defaults.rpm,
        ", concurrent ", defaults.concurrent,
        "; upstream key ", conf.upstream_auth ~= "" and "set" or "not set")
    if loaded.count == 0 then
        ngx.log(ngx.WARN, "gateway: the keys file has no keys; every /v1/ request will get 401")
    end
end

local function read_body()
    ngx.req.read_body()
    local data = ngx.req.get_body_data()
    if data then
        return data
    end
    -- Bodies larger than client_body_buffer_size were spooled to a temp file by nginx.
    local path = ngx.req.get_body_file()
    if not path then
        return nil
    end
    local f = io.open(path, "rb")
    if not f then
        return nil
    end
    data = f:read("*a")
    f:close()
    return data
end

local function too_large(size)
    return errors.send("request_too_large", {message = ("The request body is %d bytes; this gateway "
        .. "accepts at most %d. Send fewer or shorter messages or smaller images, or ask the operator "
        .. "to raise PROXY_MAX_BODY_BYTES."):format(size, conf.max_body)})
end

function M.access()
    local var = ngx.var

    -- Who: the key alone decides (Open WebUI calls from one address for all its users).
    local auth = var.http_authorization
    if not auth then
        return errors.send("missing_api_key", ASK_FOR_KEY)
    end
    local key = match(auth, "^%s*[Bb][Ee][Aa][Rr][Ee][Rr]%s+(%S+)%s*$")
    local entry = key and by_key[key]
    if not entry then
        return errors.send(key and "invalid_api_key" or "missing_api_key", ASK_FOR_KEY)
    end
    var.gw_source = entry.source
    var.gw_key_id = entry.id
    var.gw_priority = entry.priority
    -- Replaces the caller's Authorization header (proxy_set_header); empty means none is sent.
    if conf.upstream_auth ~= "" then
        var.gw_upstream_auth = conf.upstream_auth
    end

    local has_body = BODY_METHODS[ngx.req.get_method()]

    -- Refuse an announced oversize body before reading a byte of it.
    if has_body then
        local length = tonumber(var.http_content_length)
        if length and length > conf.max_body then
            return too_large(length)
        end
    end

    -- The slot first, then the rate: a request refused by either counts against neither.
    if entry.concurrent > 0 then
        if not limits.take_slot(entry.id, entry.concurrent) then
            return errors.send("too_many_concurrent_requests", {headers = {["Retry-After"] = 1},
                message = ("This API key may have %d requests in flight (streams included) and has "
                .. "that many now. Retry when one finishes (Retry-After: 1), or ask the operator for "
                .. "a higher concurrent limit."):format(entry.concurrent)})
        end
        var.gw_slot = "1"
    end
    if entry.rpm > 0 then
        local ok, wait = limits.take_rate(entry.id, entry.rpm)
        if not ok then
            if entry.concurrent > 0 then
                var.gw_slot = ""
                limits.release_slot(entry.id)
            end
            return errors.send("rate_limit_exceeded", {headers = {["Retry-After"] = wait},
                message = ("This API key may send %d requests per minute. Retry after %d s; ask the "
                .. "operator if you need a higher rpm limit."):format(entry.rpm, wait)})
        end
    end

    if not has_body then
        var.gw_affinity = affinity.key(ngx.req.get_headers(), nil)
        return
    end

    local data = read_body()
    if not data then
        return errors.send("empty_body")
    end
    if #data > conf.max_body then -- chunked bodies announce no length
        return too_large(#data)
    end
    local result, code = body.apply(data, entry.priority)
    if not result then
        return errors.send(code, {param = code == "invalid_priority" and "priority" or nil})
    end
    var.gw_priority = result.priority
    var.gw_affinity = affinity.key(ngx.req.get_headers(), result.doc)
    if result.stream then
        var.gw_stream = "true"
    end
    if result.changed then
        ngx.req.set_body_data(result.body)
    end
end

-- A stream the model server cut off (it died, or proxy_read_timeout passed): nginx has already sent the
-- 200 head and part of the events, so no error page can follow. It finalizes the request without the
-- last buffer: the body filter sees one empty, non-last buffer after the upstream's response time is
-- set ($upstream_response_time reads "-" while the upstream is still being read; its last entry is the
-- try that answered). Then an OpenAI error event goes out before nginx closes the connection, so a
-- client (the openai SDK, Open WebUI) reports an error instead of a silently short answer.
local function cut_off_stream(var)
    if var.gw_stream ~= "true" or ngx.arg[2] or ngx.arg[1] ~= "" or ngx.ctx.gw_broken then
        return false
    end
    if not find(ngx.header["Content-Type"] or "", "text/event-stream", 1, true) then
        return false
    end
    local last_try = match(var.upstream_response_time or "-", "([^%s,:]+)%s*$")
    return last_try ~= nil and last_try ~= "-"
end

-- The slot is given back before the client can have the end of the response. Giving it back in the log
-- phase only would race: a client that sends its next request as soon as the previous answer is complete
-- could reach the other worker before this one ran its log phase, and get a 429 it did not earn.
-- The last buffer's flag (ngx.arg[2]) is not early enough for an answer with a Content-Length: with
-- proxy_buffering off nginx writes the upstream's bytes to the client first and only then, when it
-- finalizes the upstream request, sends the last-buffer flag through this filter -- by which time the
-- client has every byte it was promised (CI saw that race once in 150 back-to-back requests). So such an
-- answer gives the slot back as its final byte passes here, on its way to the socket. A stream is over for
-- its client at the "data: [DONE]" event, not at the terminating chunk that nginx writes only after the
-- upstream's end reaches it: a client that stops reading at [DONE] and sends its next request at once
-- could beat the last-buffer flag here (CI saw that 429 once). So a stream gives its slot back as the
-- [DONE] event passes, and the flag is the fallback for a stream whose [DONE] was split across buffers.
function M.body_filter()
    local var = ngx.var
    if cut_off_stream(var) then
        ngx.ctx.gw_broken = true
        var.gw_error = "upstream_stream_broken"
        ngx.arg[1] = "data: " .. errors.body("upstream_stream_broken") .. "\n"
    end
    if var.gw_slot ~= "1" then
        return
    end
    local done = ngx.arg[2]
    if not done and var.gw_stream == "true" then
        done = find(ngx.arg[1], "data: [DONE]", 1, true) ~= nil
    end
    if not done then
        local length = tonumber(ngx.header["Content-Length"])
        if length then
            local ctx = ngx.ctx
            ctx.gw_sent = (ctx.gw_sent or 0) + #ngx.arg[1]
            done = ctx.gw_sent >= length
        end
    end
    if done then
        var.gw_slot = ""
        limits.release_slot(var.gw_key_id)
    end
end

-- Requests whose body never reached its end (client gone mid-stream, header-only answers) give the
-- slot back here; nginx runs the log phase for every request. Then the request is counted (source,
-- status, latency) for the metrics listener.
function M.log()
    local var = ngx.var
    if var.gw_slot == "1" then
        var.gw_slot = ""
        limits.release_slot(var.gw_key_id)
    end
    metrics.record(ngx.ctx.gw_broken)
end

function M.upstream_error(status)
    local code = status == 504 and "upstream_timeout" or "upstream_unavailable"
    return errors.send(code, {status = status, headers = {["Retry-After"] = 5}})
end

function M.internal_error()
    return errors.send("internal_error")
end

function M.too_large()
    return errors.send("request_too_large")
end

function M.not_found()
    return errors.send("not_found")
end

return M
