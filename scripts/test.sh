#!/usr/bin/env bash
# The test suite in the set-up environment ($VENV, default .venv; scripts/setup.sh makes it). Arguments go to pytest.
# Exit status: pytest's, except that 5 (no test collected) becomes 1: a run that tested nothing has failed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || { echo "ppspec test: no $VENV; run scripts/setup.sh (or make test) first" >&2; exit 1; }
echo "test: $VENV/bin/python -m pytest $*"
"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "ppspec test: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
