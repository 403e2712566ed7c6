#!/usr/bin/env bash
# Run the gateway in the foreground on Debian's nginx + libnginx-mod-http-lua: the gateway image's entry
# point (proxy/Dockerfile, compose), `make proxy`, the tests, the benchmark.
#
#   UPSTREAMS=http://127.0.0.1:8000 PORT=8080 KEYS=proxy/keys proxy/run-local.sh
#
# It renders the main nginx.conf into RUN_DIR: the load_module lines of Debian's Lua module, the listen
# addresses, the upstream block, the paths. Everything else is proxy/conf/*.conf and proxy/lua/.
#
# Settings (environment):
#   UPSTREAMS       model servers, http://host:port[,http://...]  (default http://127.0.0.1:8000; UPSTREAM,
#                   one server, is read when UPSTREAMS is unset). Several: a conversation sticks to one
#                   server (hash of gateway.affinity's key, consistent), docs/scale-out.md
#   UPSTREAM_FAIL_TIMEOUT  seconds a server that failed a connection is left out (default 10)
#   PORT, LISTEN    where the gateway listens                      (default 8080 on 127.0.0.1)
#   METRICS_PORT    Prometheus metrics listener, "off" for none    (default 9145)
#   METRICS_LISTEN  its address: it has no key, so loopback unless  (default 127.0.0.1; the gateway image sets
#                   a private network is all that reaches it        0.0.0.0: compose never publishes 9145)
#   KEYS            keys file                                      (default proxy/keys)
#   RUN_DIR         rendered config, pid, temp files               (default ${TMPDIR:-/tmp}/gateway-$PORT)
#   ACCESS_LOG      JSON access log                                (default /dev/stdout)
#   PROXY_WORKERS   nginx worker processes                         (default auto)
#   UPSTREAM_API_KEY, PROXY_MAX_BODY_BYTES, PROXY_RPM, PROXY_CONCURRENT: see docs/proxy.md
#
# Reload after editing the keys file (connections in flight are kept):
#   nginx -p "$RUN_DIR/" -c nginx.conf -s reload        (or: kill -HUP "$(cat "$RUN_DIR/nginx.pid")")
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

UPSTREAMS=${UPSTREAMS:-${UPSTREAM:-http://127.0.0.1:8000}}
UPSTREAM_FAIL_TIMEOUT=${UPSTREAM_FAIL_TIMEOUT:-10}
PORT=${PORT:-8080}
LISTEN=${LISTEN:-127.0.0.1}
METRICS_PORT=${METRICS_PORT:-9145}
METRICS_LISTEN=${METRICS_LISTEN:-127.0.0.1}
KEYS=${KEYS:-$here/keys}
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/gateway-$PORT}
ACCESS_LOG=${ACCESS_LOG:-/dev/stdout}
PROXY_WORKERS=${PROXY_WORKERS:-auto}
NGINX=${NGINX:-nginx}
MODULES=${NGINX_MODULES:-/usr/lib/nginx/modules}

die() { echo "run-local.sh: $*" >&2; exit 2; }

command -v "$NGINX" >/dev/null \
    || die "no nginx; install it: apt-get install -y nginx libnginx-mod-http-lua lua-cjson"
for m in ndk_http_module.so ngx_http_lua_module.so; do
    [[ -f $MODULES/$m ]] \
        || die "missing $MODULES/$m; install it: apt-get install -y libnginx-mod-http-lua lua-cjson"
done

# Only plain http upstreams: vLLM listens in plain HTTP next to the gateway (a server on another PC is
# reached over the LAN with its own key, UPSTREAM_API_KEY).
[[ $UPSTREAM_FAIL_TIMEOUT =~ ^[1-9][0-9]*$ ]] \
    || die "UPSTREAM_FAIL_TIMEOUT must be a whole number of seconds > 0, got '$UPSTREAM_FAIL_TIMEOUT'"
IFS=, read -r -a upstream_list <<<"$UPSTREAMS"
upstream_addrs=()
for u in "${upstream_list[@]}"; do
    u=${u//[[:space:]]/}
    [[ -n $u ]] || continue
    [[ $u =~ ^http://([A-Za-z0-9._-]+(:[0-9]+)?)/?$ ]] \
        || die "UPSTREAMS must be a comma-separated list of http://host:port, got '$u' in '$UPSTREAMS'"
    a=${BASH_REMATCH[1]}
    [[ $a == *:* ]] || a="$a:80"
    for seen in "${upstream_addrs[@]}"; do
        [[ $seen != "$a" ]] || die "UPSTREAMS names $a twice"
    done
    upstream_addrs+=("$a")
done
(( ${#upstream_addrs[@]} > 0 )) || die "UPSTREAMS is empty: name at least one model server, http://host:port"

# One server: never marked down (there is nowhere else to send a request; a 502 says it is unreachable).
# Several: a server that fails a connection (refused, reset, connect timeout) is left out for
# UPSTREAM_FAIL_TIMEOUT seconds, then tried again by live requests: nginx's passive health check. A
# conversation is hashed onto the ring by its affinity key (gateway.affinity); `consistent` moves only
# the conversations of a server that left, and moves them back when it rejoins.
upstream_servers=""
if (( ${#upstream_addrs[@]} == 1 )); then
    upstream_servers="server ${upstream_addrs[0]} max_fails=0;"
else
    upstream_servers="hash \$gw_affinity consistent;"
    for a in "${upstream_addrs[@]}"; do
        upstream_servers+="
        server $a max_fails=1 fail_timeout=${UPSTREAM_FAIL_TIMEOUT}s;"
    done
fi
[[ $PORT =~ ^[0-9]+$ ]] || die "PORT must be a number, got '$PORT'"
[[ $METRICS_PORT =~ ^([0-9]+|off)$ ]] || die "METRICS_PORT must be a number or off, got '$METRICS_PORT'"
[[ $METRICS_PORT != "$PORT" ]] || die "METRICS_PORT must differ from PORT (the metrics need no key)"
[[ -r $KEYS ]] || die "cannot read keys file '$KEYS' (copy proxy/keys.example to proxy/keys and edit it)"
keys_file=$(cd "$(dirname "$KEYS")" && pwd)/$(basename "$KEYS")

mkdir -p "$RUN_DIR"
RUN_DIR=$(cd "$RUN_DIR" && pwd)

# As root, nginx would switch its workers to `nobody`, who cannot enter a private RUN_DIR (pytest's
# tmp dirs are 0700) to spool large request bodies. Keep the invoking user instead.
user_line=""
if [[ $EUID -eq 0 ]]; then
    user_line="user root root;"
fi

# The metrics listener has no key: loopback unless METRICS_LISTEN says otherwise, whatever LISTEN says.
metrics_server=""
if [[ $METRICS_PORT != off ]]; then
    metrics_server="server {
        listen $METRICS_LISTEN:$METRICS_PORT;
        include $here/conf/metrics.conf;
    }"
fi

cat >"$RUN_DIR/nginx.conf" <<EOF
# Rendered by proxy/run-local.sh; edits here are lost at the next start.
# Debian's nginx loads Lua as dynamic modules.
load_module $MODULES/ndk_http_module.so;
load_module $MODULES/ngx_http_lua_module.so;

$user_line
daemon off;
worker_processes $PROXY_WORKERS;
pid $RUN_DIR/nginx.pid;
error_log stderr notice;

# nginx clears its processes' environment; these are the variables gateway.handler reads.
env PROXY_KEYS_FILE;
env UPSTREAM_API_KEY;
env PROXY_MAX_BODY_BYTES;
env PROXY_RPM;
env PROXY_CONCURRENT;

events {
    worker_connections 4096;
}

http {
    lua_package_path "$here/lua/?.lua;;";

    # Debian's nginx has absolute temp paths under /var/lib/nginx compiled in; keep ours private.
    client_body_temp_path $RUN_DIR/client_body;
    proxy_temp_path $RUN_DIR/proxy_temp;
    fastcgi_temp_path $RUN_DIR/fastcgi_temp;
    uwsgi_temp_path $RUN_DIR/uwsgi_temp;
    scgi_temp_path $RUN_DIR/scgi_temp;

    upstream model_upstream {
        # Shared by the workers: which servers are down (passive health checks) is one state, so a
        # server that rejoins is used by every worker at once, not by each after its own timeout.
        zone model_upstream 256k;
        $upstream_servers
        keepalive 64;
        # Shorter than uvicorn's 5 s keep-alive, so nginx never sends a request on a connection the
        # model server is closing (a POST that hits one is not retried and would end in a 502).
        keepalive_timeout 4s;
        keepalive_requests 100000;
    }

    include $here/conf/http.conf;
    access_log $ACCESS_LOG gateway_json;

    server {
        listen $LISTEN:$PORT;
        include $here/conf/server.conf;
    }

    # Prometheus metrics (gateway.metrics), no key (METRICS_LISTEN).
    $metrics_server
}
EOF

export PROXY_KEYS_FILE=$keys_file

echo "gateway: http://$LISTEN:$PORT -> ${upstream_addrs[*]}, keys $keys_file" >&2
[[ $METRICS_PORT == off ]] || echo "gateway: metrics at http://$METRICS_LISTEN:$METRICS_PORT/metrics" >&2
echo "gateway: reload after editing keys: $NGINX -p $RUN_DIR/ -c nginx.conf -s reload" >&2

# exec: the caller's pid is nginx's master, so Ctrl-C, SIGTERM and SIGHUP (reload) reach it directly.
exec "$NGINX" -p "$RUN_DIR/" -c nginx.conf -e stderr
