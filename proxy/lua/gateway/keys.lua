-- gateway.keys: read the operator's keys file.
--
-- One line per key:   <key> <source> <priority> [rpm=N] [concurrent=N]
-- `#` starts a comment (at the start of a line or after whitespace); blank lines are ignored.
--   source      a name for the logs and for grouping (openwebui, agents, benchmarks, ...)
--   priority    integer sent to vLLM as "priority"; lower runs first
--   rpm         requests per minute for this key (0 = unlimited; default from PROXY_RPM)
--   concurrent  requests in flight, streams included, for this key (0 = unlimited; PROXY_CONCURRENT)
--
-- The file is read once per nginx configuration load (start and `nginx -s reload`), in the master
-- process, before workers fork. Any mistake fails the load with the line number: at start nginx does not
-- come up, and on reload nginx keeps serving with the previous keys instead of half-reading a broken
-- file. Keys are identified by a short md5 fingerprint in logs and counters; the key itself is never
-- logged.

local M = {}

local OPTIONS = {rpm = true, concurrent = true}

local function fingerprint(key)
    return ngx.md5(key):sub(1, 10)
end

-- load(path, defaults) -> {by_key = {[key] = entry}, count = n} or nil, message
-- entry = {source, priority (number), id, rpm, concurrent}
-- defaults = {rpm = n, concurrent = n}
function M.load(path, defaults)
    local f, err = io.open(path, "r")
    if not f then
        return nil, "cannot read keys file " .. path .. ": " .. tostring(err)
            .. " (set PROXY_KEYS_FILE; see proxy/keys.example)"
    end
    local text = f:read("*a")
    f:close()

    local by_key, count, seen_on = {}, 0, {}
    local lineno = 0
    for line in (text .. "\n"):gmatch("([^\n]*)\n") do
        lineno = lineno + 1
        local function fail(why)
            return nil, ("keys file %s line %d: %s (format: <key> <source> <priority> "
                .. "[rpm=N] [concurrent=N])"):format(path, lineno, why)
        end
        -- Strip comments: a leading #, or a # after whitespace (a # inside a key is kept).
        line = line:gsub("^%s*#.*$", ""):gsub("%s+#.*$", "")
        local fields = {}
        for field in line:gmatch("%S+") do
            fields[#fields + 1] = field
        end
        if #fields > 0 then
            if #fields < 3 then
                return fail("expected at least 3 fields, found " .. #fields)
            end
            local key, source, prio = fields[1], fields[2], fields[3]
            if not source:find("^[%w_.:%-]+$") then
                return fail("source must be letters, digits, _ . : or -")
            end
            if not prio:find("^%-?%d+$") then
                return fail("priority must be an integer")
            end
            if seen_on[key] then
                return fail("the same key is already on line " .. seen_on[key])
            end
            local entry = {
                source = source,
                priority = tonumber(prio),
                id = fingerprint(key),
                rpm = defaults.rpm,
                concurrent = defaults.concurrent,
            }
            for i = 4, #fields do
                local name, value = fields[i]:match("^(%a+)=(%d+)$")
                if not name or not OPTIONS[name] then
                    return fail("unknown option '" .. fields[i] .. "' (rpm=N or concurrent=N)")
                end
                entry[name] = tonumber(value)
            end
            seen_on[key] = lineno
            by_key[key] = entry
            count = count + 1
        end
    end
    return {by_key = by_key, count = count}
end

return M
