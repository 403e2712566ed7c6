-- gateway.errors: every response the gateway produces itself, in OpenAI's error shape
--   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
-- OpenAI clients (the openai SDK, Open WebUI) show error.message to the person at the keyboard, so each
-- message says what to do next, not only what went wrong.
--
-- The JSON is written by hand: it is four short strings, and cjson would escape every "/" in the
-- messages as "\/" (Debian's cjson cannot be told not to).

local ngx = ngx
local format, gsub, byte = string.format, string.gsub, string.byte

local M = {}

-- The catalogue: one entry per error code, so docs/proxy.md's table and the tests have a single source.
-- status, type, default message.
M.CATALOGUE = {
    missing_api_key = {401, "invalid_request_error",
        "No API key. Send the header 'Authorization: Bearer <key>' with a key the operator gave you."},
    invalid_api_key = {401, "invalid_request_error",
        "This API key is not known to the gateway. Check it for typos, or ask the operator to add it "
        .. "to the keys file and reload the gateway."},
    empty_body = {400, "invalid_request_error",
        "The request body is empty. POST a JSON object, e.g. {\"model\": ..., \"messages\": [...]}."},
    invalid_json = {400, "invalid_request_error",
        "The request body is not valid JSON. Send a JSON object with Content-Type: application/json."},
    not_an_object = {400, "invalid_request_error",
        "The request body must be a JSON object ({...}), not an array, string, number or null."},
    invalid_priority = {400, "invalid_request_error",
        "'priority' must be an integer. Leave it out to get your key's priority; a larger number "
        .. "(lower priority) than your key's is allowed, a smaller one is raised to your key's."},
    request_too_large = {413, "invalid_request_error",
        "The request body is too large for this gateway. Send fewer or shorter messages or smaller "
        .. "images, or ask the operator to raise PROXY_MAX_BODY_BYTES."},
    rate_limit_exceeded = {429, "rate_limit_error",
        "Too many requests for this API key in the last minute. Wait for the number of seconds in "
        .. "the Retry-After header, then retry; ask the operator if you need a higher rpm limit."},
    too_many_concurrent_requests = {429, "rate_limit_error",
        "Too many requests in flight for this API key. Wait for one of your running requests or "
        .. "streams to finish (see Retry-After), then retry; or ask the operator for a higher "
        .. "concurrent limit."},
    not_found = {404, "invalid_request_error",
        "Unknown path. This gateway serves the OpenAI API under /v1/ (e.g. POST /v1/chat/completions, "
        .. "GET /v1/models) and /healthz."},
    internal_error = {500, "server_error",
        "The gateway failed while handling this request. Retry; if it persists, the operator should "
        .. "check the gateway's error log."},
    upstream_unavailable = {502, "server_error",
        "The model server is not reachable (it may still be loading the model, or it stopped). "
        .. "Retry in a minute; if it persists, the operator should check the model server's logs."},
    upstream_stream_broken = {502, "server_error",
        "The model server stopped in the middle of this answer (it went down or stopped responding), "
        .. "so the text so far is incomplete. Send the request again: the gateway passes it to a model "
        .. "server that is up."},
    upstream_timeout = {504, "server_error",
        "The model server did not answer in time. Retry; if it persists, the operator should check "
        .. "the model server's logs and load."},
}

local ESCAPES = {['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t"}

local function json_string(s)
    if s == nil then
        return "null"
    end
    return '"' .. gsub(s, '[%c"\\]', function(c)
        return ESCAPES[c] or format("\\u%04x", byte(c))
    end) .. '"'
end

-- The JSON text of an error. param is JSON null when absent, as in OpenAI's responses.
function M.body(code, message, param)
    local entry = M.CATALOGUE[code]
    return format('{"error":{"message":%s,"type":%s,"param":%s,"code":%s}}\n',
        json_string(message or entry[3]), json_string(entry[2]), json_string(param), json_string(code))
end

-- Sends the error and ends the request. status overrides the catalogue's (502 vs 503 share a code).
-- headers: optional extra response headers (Retry-After, WWW-Authenticate).
function M.send(code, opts)
    opts = opts or {}
    local entry = M.CATALOGUE[code]
    local status = opts.status or entry[1]
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    if opts.headers then
        for name, value in pairs(opts.headers) do
            ngx.header[name] = value
        end
    end
    -- The access log shows which of our own errors ended the request.
    ngx.var.gw_error = code
    ngx.print(M.body(code, opts.message, opts.param))
    return ngx.exit(status)
end

return M
