-- gateway.affinity: the key that keeps one conversation on one model server.
--
--   key(headers, doc) -> string   ("" when the request names no conversation)
--
-- The rendered upstream block hashes $gw_affinity onto a consistent ring (run-local.sh, several
-- UPSTREAMS): every turn of a conversation reaches the server that holds its prefix in vLLM's prefix
-- cache (report 000: 28% -> 99% prefix hits with a fine match unit; all lost if turns alternate PCs),
-- different conversations spread over the servers, and only the conversations of a server that left
-- move. An empty key falls back to round robin (nginx's hash does so itself): GET /v1/models, bodies
-- with no messages or prompt.
--
-- What clients send, in the order used:
--   1. X-OpenWebUI-Chat-Id  Open WebUI's chat id; sent when the UI runs with
--                           ENABLE_FORWARD_USER_INFO_HEADERS=true (compose sets it). One per chat,
--                           whatever the UI changes in the system prompt between turns.
--   2. X-Session-Id         a script's or agent's own name for its conversation (docs/scale-out.md).
--   3. the body             a chat request's first system message and first user message: every later
--                           turn of the same conversation sends them again, unchanged, as its prefix.
--                           A completions request: the first PROMPT_PREFIX bytes of its prompt.
-- The body's texts are hashed (md5): the key is short and says nothing of the conversation.

local ngx = ngx
local type, ipairs, concat, sub = type, ipairs, table.concat, string.sub

local M = {}

-- Bytes of a completions prompt that identify its conversation: long enough to pass a shared
-- instruction header, short enough that a growing transcript keeps its key.
M.PROMPT_PREFIX = 4096

local HEADERS = {"x-openwebui-chat-id", "x-session-id"}

-- A message's content as text: a string as is; an array of parts (text, image_url, ...) as its text
-- parts and image URLs in order. Anything else (null, a number) as "".
local function content_text(content)
    if type(content) == "string" then
        return content
    end
    if type(content) ~= "table" then
        return ""
    end
    local out = {}
    for i = 1, #content do
        local part = content[i]
        if type(part) == "table" then
            if type(part.text) == "string" then
                out[#out + 1] = part.text
            elseif type(part.image_url) == "table" and type(part.image_url.url) == "string" then
                out[#out + 1] = part.image_url.url
            end
        end
    end
    return concat(out, "\n")
end

local function from_messages(messages)
    local system, user
    for i = 1, #messages do
        local m = messages[i]
        if type(m) == "table" then
            local role = m.role
            if not system and (role == "system" or role == "developer") then
                system = content_text(m.content)
            elseif not user and role == "user" then
                user = content_text(m.content)
            end
            if user then
                break -- a system message after the first user turn is not part of the prefix
            end
        end
    end
    if not system and not user then
        return nil
    end
    return (system or "") .. "\0" .. (user or "")
end

local function from_body(doc)
    if type(doc) ~= "table" then
        return nil
    end
    if type(doc.messages) == "table" then
        return from_messages(doc.messages)
    end
    local prompt = doc.prompt
    if type(prompt) == "table" then
        prompt = prompt[1] -- a batch of prompts: the first decides
    end
    if type(prompt) == "string" and prompt ~= "" then
        return sub(prompt, 1, M.PROMPT_PREFIX)
    end
    return nil
end

-- headers: ngx.req.get_headers() (lower-case names); doc: the decoded JSON body, or nil.
function M.key(headers, doc)
    for _, name in ipairs(HEADERS) do
        local value = headers[name]
        if type(value) == "table" then
            value = value[1]
        end
        if type(value) == "string" and value ~= "" then
            return name == "x-session-id" and ("s:" .. value) or ("c:" .. value)
        end
    end
    local text = from_body(doc)
    if text then
        return "m:" .. ngx.md5(text)
    end
    return ""
end

return M
