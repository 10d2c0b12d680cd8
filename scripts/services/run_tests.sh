#!/usr/bin/env bash
# Runs the tests. Starts what the tests need; pytest's "no tests collected" (5) is a failure of the suite's
# wiring, not a pass, so it is reported as such.
#
# Two pytest runs side by side on the machine's two cores: the unit tests (tests/unit: mostly one Python
# thread each) beside the live ones (tests/e2e, tests/slurm: an engine start is mostly one interpreter
# importing). Each test keeps to its own ports, folders and /dev/shm names, so neither run can see the
# other's. MXLAUNCH_TESTS_SERIAL=1 runs them one after the other.
#
# MXLAUNCH_LIVE_SETUP: a command the live tests need first and the unit tests do not (make test: installing
# SGLang's venv). It runs while the unit tests do, so they overlap the install, not the engine starts (an
# engine start on these two cores takes about twice as long with the unit tests beside it).
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
trap 'rm -f "$UNIT_LOG"' EXIT
setup() {  # MXLAUNCH_LIVE_SETUP, timed; its failure is the live run's
  [ -n "${MXLAUNCH_LIVE_SETUP:-}" ] || return 0
  local t0=$SECONDS
  bash -c "$MXLAUNCH_LIVE_SETUP" || { echo "run_tests: the live tests' setup failed: $MXLAUNCH_LIVE_SETUP" >&2; return 1; }
  echo "run_tests: live setup done in $((SECONDS - t0)) s ($MXLAUNCH_LIVE_SETUP)"
}
live() {
  setup || return 1
  # the CRIU kit the setup built (make criu-kit): the zygote-image tests and --zygote launches use it
  if [ -z "${MXLAUNCH_CRIU:-}" ] && [ -x .criu4-kit/run.sh ]; then export MXLAUNCH_CRIU=$PWD/.criu4-kit/run.sh; fi
  "$PY" -m pytest -m "(e2e or slurm or redis)$NOT_FULL" --durations=25 tests/e2e tests/slurm "$@"; }
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
