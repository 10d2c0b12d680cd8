#!/usr/bin/env bash
# A throw-away redis-server on this host, for the redis tests and for trying a redis:// peer registry.
#
#   scripts/services/start_redis.sh start DIR [PASSWORD]
#                                      install Debian's redis-server if missing (needs root), start it on a
#                                      free loopback port with DIR as its working folder and no persistence
#                                      (no RDB snapshots, no AOF), with `requirepass PASSWORD` when given,
#                                      wait until it answers PING, print the port
#   scripts/services/start_redis.sh stop DIR    stop the server started for DIR
#
# Then: mxlaunch peers --registry redis://:PASSWORD@127.0.0.1:PORT/0 (mxlaunch refuses a Redis registry
# without a password unless MXLAUNCH_REDIS_TRUSTED=1)
#
# Idempotent: a DIR whose server still runs is left alone (its port is printed again); everything (config,
# pid file, log) lives in DIR, so several servers can run side by side and nothing outside DIR
# changes — except the one-time apt-get install.
set -euo pipefail

# apt-get, one at a time: the test suite's set-up steps (Redis, Slurm, the CRIU kit) may install side by side,
# and a second apt-get fails at once on dpkg's lock
apt_get() { flock /tmp/mxlaunch-apt.lock apt-get -o DPkg::Lock::Timeout=600 "$@"; }


die() { echo "start_redis: $*" >&2; exit 2; }

install_redis() {
  command -v redis-server >/dev/null && return 0
  [ "$(id -u)" -eq 0 ] || die "redis-server is not installed and this is not root — run: sudo apt-get install redis-server"
  command -v apt-get >/dev/null || die "redis-server is not installed and there is no apt-get — install redis-server (7.x) by hand"
  echo "start_redis: installing redis-server (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt_get update -qq >&2
  apt_get install -y -qq --no-install-recommends redis-server >&2
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

alive() {  # alive PIDFILE: the process named in PIDFILE runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

answers() {  # answers PORT: the server on PORT says PONG (no redis-cli needed); logs in first with $PASSWORD
  REDIS_AUTH="$PASSWORD" python3 - "$1" <<'PY' 2>/dev/null
import os, socket, sys, time
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2) as s:
    pw = os.environ.get("REDIS_AUTH", "")
    s.sendall((f"AUTH {pw}\r\nPING\r\n" if pw else "PING\r\n").encode())
    want = b"+OK\r\n+PONG" if pw else b"+PONG"
    got, deadline = b"", time.time() + 2
    while len(got) < len(want) and time.time() < deadline:
        got += s.recv(64)
    sys.exit(0 if got.startswith(want) else 1)
PY
}

start() {
  install_redis
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  if alive "$DIR/redis.pid" && [ -s "$DIR/port" ] && answers "$(cat "$DIR/port")"; then
    cat "$DIR/port"
    return 0
  fi
  local port
  port=$(free_port)
  {
    echo "# written by scripts/services/start_redis.sh"
    echo "bind 127.0.0.1"
    echo "port $port"
    echo "protected-mode yes"
    echo "daemonize yes"
    echo "dir $DIR"
    echo "pidfile $DIR/redis.pid"
    echo "logfile $DIR/redis.log"
    echo "save \"\""
    echo "appendonly no"
    [ -z "$PASSWORD" ] || echo "requirepass $PASSWORD"
  } >"$DIR/redis.conf"
  chmod 600 "$DIR/redis.conf"
  redis-server "$DIR/redis.conf"
  local deadline=$((SECONDS + 30))
  until answers "$port" 2>/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || die "redis-server did not answer on port $port (see $DIR/redis.log)"
    sleep 0.2
  done
  echo "$port" >"$DIR/port"
  echo "$port"
}

stop() {
  alive "$DIR/redis.pid" || return 0
  local pid
  pid=$(cat "$DIR/redis.pid")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  kill -KILL "$pid" 2>/dev/null || true
}

[ $# -eq 2 ] || [ $# -eq 3 ] || die "usage: $0 start DIR [PASSWORD] | stop DIR"
cmd=$1
DIR=$2
PASSWORD=${3:-}
case "$PASSWORD" in *[!A-Za-z0-9_-]*) die "a password of letters, digits, _ and - only" ;; esac
case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) die "unknown command '$cmd' (start or stop)" ;;
esac
