-- gateway.body: validate a JSON request body and set its top-level "priority", changing no other byte.
--
-- Why not decode, set the field and encode again: Debian's lua-cjson turns `[]` into `{}` and cuts
-- integers to 14 digits, and any encoder reorders keys and rewrites escapes. `"stop": []`, tool schemas
-- and 19-digit sampling seeds would reach the model changed. So cjson only *validates* the body (and
-- reads "stream"); the priority is changed by splicing bytes:
--   * a top-level "priority" exists: its value's bytes are replaced (or kept, see the rule below);
--   * none exists: `"priority":P,` is inserted right after the opening `{` (`"priority":P` for `{}`).
--
-- The priority rule: a caller may ask for a larger number (lower priority) than its key's, never a
-- smaller one. A smaller one is replaced by the key's. Only integers are accepted (vLLM's field is int);
-- JSON null counts as absent.
--
-- Most bodies carry no "priority": cjson's decoded table says so (it decodes escaped keys too), and the
-- member is inserted without looking further. Only when a top-level "priority" exists does the scanner
-- below locate its bytes. It runs only on bodies cjson has already accepted, so it can trust the
-- structure: it jumps between structural bytes with string.find instead of walking every byte.

local cjson = require "cjson.safe"

local find, byte, sub, tonumber, concat, next = string.find, string.byte, string.sub, tonumber, table.concat, next

local M = {}

-- A private decoder instance, strict about numbers (no hex, NaN or Infinity, which Python's json, and so
-- vLLM, would not read the same way).
local decoder = cjson.new()
decoder.decode_invalid_numbers(false)

local B_OBJ_OPEN, B_OBJ_CLOSE = byte("{"), byte("}")
local B_ARR_OPEN, B_ARR_CLOSE = byte("["), byte("]")
local B_QUOTE, B_BACKSLASH, B_COMMA = byte('"'), byte("\\"), byte(",")
local B_SPACE, B_TAB, B_LF, B_CR = byte(" "), byte("\t"), byte("\n"), byte("\r")

local function is_ws(b)
    return b == B_SPACE or b == B_LF or b == B_CR or b == B_TAB
end

-- Index of the closing quote of the string whose opening quote is at `open`. A quote is escaped when
-- an odd number of backslashes precedes it. Plain find (memchr speed, and JIT-compiled) jumps from
-- quote to quote, so a long message costs one call per escaped quote, not per byte.
local function string_end(body, open)
    local pos = open + 1
    while true do
        local q = find(body, '"', pos, true)
        local k = q - 1
        while byte(body, k) == B_BACKSLASH do
            k = k - 1
        end
        if (q - 1 - k) % 2 == 0 then
            return q
        end
        pos = q + 1
    end
end

-- True if the raw key bytes (between the quotes) name "priority". A key may be written with escapes
-- ("pri\u006frity"); vLLM decodes it to "priority", so we must too, or a caller could slip past the rule.
local function is_priority_key(raw)
    if raw == "priority" then
        return true
    end
    if find(raw, "\\", 1, true) then
        return decoder.decode('"' .. raw .. '"') == "priority"
    end
    return false
end

-- Finds every top-level "priority" member of the object that opens at `open`. Returns a list of
-- {first, last} byte ranges of their values (duplicates are legal JSON; Python keeps the last one, so
-- all of them are handled).
local function scan_top_level(body, open)
    local ranges = {}
    local depth = 1
    local expecting_key = true
    local pending -- start index of a top-level priority value whose end is not yet known
    local pos = open + 1

    while true do
        local p = find(body, '[{}%[%]",]', pos)
        local b = byte(body, p)
        if b == B_QUOTE then
            local q = string_end(body, p)
            if depth == 1 and expecting_key then
                expecting_key = false
                local colon = find(body, ":", q + 1, true)
                local vstart = find(body, "[^ \t\r\n]", colon + 1)
                if is_priority_key(sub(body, p + 1, q - 1)) then
                    pending = vstart
                end
                pos = vstart -- the value itself (string, object, ...) is handled by the loop
            else
                pos = q + 1
            end
        elseif b == B_OBJ_OPEN or b == B_ARR_OPEN then
            depth = depth + 1
            pos = p + 1
        elseif b == B_COMMA then
            if depth == 1 then
                if pending then
                    local last = p - 1
                    while is_ws(byte(body, last)) do last = last - 1 end
                    ranges[#ranges + 1] = {pending, last}
                    pending = nil
                end
                expecting_key = true
            end
            pos = p + 1
        else -- } or ]
            if depth == 1 then
                if pending then
                    local last = p - 1
                    while is_ws(byte(body, last)) do last = last - 1 end
                    ranges[#ranges + 1] = {pending, last}
                end
                return ranges
            end
            depth = depth - 1
            pos = p + 1
        end
    end
end

-- apply(body, key_priority) -> result or nil, error_code
-- result = {body = bytes to forward, changed = bool, priority = effective priority (string),
--           stream = bool, doc = the decoded body (read only: gateway.affinity reads its messages)}
function M.apply(body, key_priority)
    local first = find(body, "[^ \t\r\n]")
    if not first then
        return nil, "empty_body"
    end
    local doc = decoder.decode(body)
    if doc == nil then
        return nil, "invalid_json"
    end
    -- Checked on the bytes, not the decoded value: Debian's cjson decodes [] and {} to the same table.
    if byte(body, first) ~= B_OBJ_OPEN then
        return nil, "not_an_object"
    end

    local stream = doc.stream == true
    local wanted = tostring(key_priority)

    if doc.priority == nil then -- JSON null decodes to cjson.null, not nil: it is handled below
        local member = next(doc) == nil and ('"priority":' .. wanted) or ('"priority":' .. wanted .. ",")
        return {
            body = concat({sub(body, 1, first), member, sub(body, first + 1)}),
            changed = true, priority = wanted, stream = stream, doc = doc,
        }
    end

    local ranges = scan_top_level(body, first)
    if #ranges == 0 then
        -- cjson saw a top-level priority the scanner did not: refuse rather than forward a body whose
        -- priority we could not check.
        return nil, "invalid_priority"
    end

    -- The caller's value is the last occurrence (what vLLM would read).
    local last = ranges[#ranges]
    local raw = sub(body, last[1], last[2])
    local effective
    if raw == "null" then
        effective = wanted
    elseif find(raw, "^%-?%d+$") then
        -- tonumber of a huge integer is a float; good enough to compare, and the bytes are kept as sent.
        effective = (tonumber(raw) >= key_priority) and raw or wanted
    else
        return nil, "invalid_priority"
    end

    -- Keep the body untouched when its (single) value already complies.
    if #ranges == 1 and effective == raw then
        return {body = body, changed = false, priority = raw, stream = stream, doc = doc}
    end

    local parts, from = {}, 1
    for i = 1, #ranges do
        local r = ranges[i]
        parts[#parts + 1] = sub(body, from, r[1] - 1)
        parts[#parts + 1] = effective
        from = r[2] + 1
    end
    parts[#parts + 1] = sub(body, from)
    return {body = concat(parts), changed = true, priority = effective, stream = stream, doc = doc}
end

return M
