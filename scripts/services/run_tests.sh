#!/usr/bin/env bash
# Runs the tests. Starts what the tests need; pytest's "no tests collected" (5) is a failure of the suite's
# wiring, not a pass, so it is reported as such.
#
# Two pytest runs side by side on the machine's two cores: the unit tests (tests/unit: mostly one Python
# thread each) beside the live ones (tests/e2e, tests/slurm: an engine start is mostly one interpreter
# importing). Each test keeps to its own ports, folders and /dev/shm names, so neither run can see the
# other's. MXLAUNCH_TESTS_SERIAL=1 runs them one after the other.
#
# MXLAUNCH_LIVE_SETUP: a command some live tests need and the unit tests do not (make test: SGLang's venv and
# the CRIU kit, ~2.5 min). It runs in the background beside both runs; the live tests that need what it builds
# (marked `live_setup`) run last and wait for its exit code in MXLAUNCH_LIVE_SETUP_STATUS
# (tests/helpers/live_setup.py) — they never skip, and a failed setup fails them.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${VENV:-.venv}/bin/python
# The suite writes a few GiB under $TMPDIR and /dev/shm; a run that fails for want of room shows it here.
df -h "${TMPDIR:-/tmp}" /dev/shm 2>/dev/null | sed 's/^/run_tests: /'
# The default run: one live e2e per capability. `--full` (make test-full, before each release of a capability)
# adds the tests marked `full`: second live runs of capabilities the default run already covers.
NOT_FULL=" and not full"
if [ "${1:-}" = "--full" ]; then
  shift
  NOT_FULL=""
fi
verdict() {  # pytest's code, with "collected nothing" made a failure
  if [ "$1" -eq 5 ]; then
    echo "run_tests: pytest collected no $2 tests — the suite is miswired" >&2
    return 1
  fi
  return "$1"
}
UNIT_LOG=$(mktemp "${TMPDIR:-/tmp}/run_tests-unit.XXXXXX")
# the setup's exit code, in a folder of this run's own (0700: nobody else can plant a "0" before the setup ends)
SETUP_DIR=$(mktemp -d "${TMPDIR:-/tmp}/run_tests-setup.XXXXXX")
SETUP_STATUS=$SETUP_DIR/status
trap 'rm -rf "$UNIT_LOG" "$SETUP_DIR"' EXIT
setup() {  # MXLAUNCH_LIVE_SETUP, timed; its exit code lands whole in $SETUP_STATUS
  local t0=$SECONDS rc=0
  # niced: the live run is the suite's longest path; the setup has until the live_setup tests, ~25 min later
  nice -n 10 bash -c "$MXLAUNCH_LIVE_SETUP" || rc=$?
  if [ "$rc" -eq 0 ]; then echo "run_tests: live setup done in $((SECONDS - t0)) s ($MXLAUNCH_LIVE_SETUP)"
  else echo "run_tests: the live tests' setup failed ($rc): $MXLAUNCH_LIVE_SETUP" >&2; fi
  echo "$rc" > "$SETUP_STATUS.tmp" && mv "$SETUP_STATUS.tmp" "$SETUP_STATUS"
}
live() {
  local setup_pid="" rc
  if [ -n "${MXLAUNCH_LIVE_SETUP:-}" ]; then
    setup & setup_pid=$!
    export MXLAUNCH_LIVE_SETUP_STATUS=$SETUP_STATUS
  fi
  "$PY" -m pytest -m "(e2e or slurm or redis)$NOT_FULL" --durations=25 tests/e2e tests/slurm "$@"; rc=$?
  if [ -n "$setup_pid" ]; then  # a selection without live_setup tests leaves nothing half-built either,
    wait "$setup_pid"           # and a failed setup fails the live run even where no test needed it
    [ "$(cat "$SETUP_STATUS" 2>/dev/null)" = 0 ] || [ "$rc" -ne 0 ] || rc=1
  fi
  return "$rc"; }
unit() { "$PY" -m pytest -m "unit$NOT_FULL" --durations=15 tests/unit "$@"; }
if [ -n "${MXLAUNCH_TESTS_SERIAL:-}" ]; then
  unit "$@"; rc_unit=$?
  live "$@"; rc_live=$?
else
  unit "$@" > "$UNIT_LOG" 2>&1 &
  unit_pid=$!
  live "$@"; rc_live=$?
  wait "$unit_pid"; rc_unit=$?
  echo "run_tests: the unit tests (run beside the live ones):"
  cat "$UNIT_LOG"
fi
df -h "${TMPDIR:-/tmp}" /dev/shm 2>/dev/null | sed 's/^/run_tests: /'
verdict "$rc_unit" unit; rc_unit=$?
verdict "$rc_live" live; rc_live=$?
[ "$rc_unit" -eq 0 ] && [ "$rc_live" -eq 0 ]
