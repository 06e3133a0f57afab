#!/usr/bin/env bash
# Run every check of the project: ruff, mypy, the systemd unit checks (once the units exist)
# and the pytest suite. Runs all of them, then exits non-zero if any failed.
# Extra arguments go to pytest (e.g. `scripts/test.sh -k engine`).
# Environment: CHANDRAD_VENV (default <repo>/.venv), PYTEST_TIMEOUT (seconds per test),
# PYTEST_WORKERS (test processes; default 2 where nproc >= 2, 0 = one process).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CHANDRAD_VENV:-$REPO/.venv}"
cd "$REPO"

failed=()
run() {
    local name=$1 t0=$SECONDS rc=0
    shift
    printf '[test] %s\n' "$name"
    "$@" || rc=$?
    printf '[test] %s: rc=%d (%ds)\n' "$name" "$rc" "$((SECONDS - t0))"
    ((rc == 0)) || failed+=("$name")
}

# Test processes: two where there are two CPUs or more. A vLLM start-up is single-threaded
# for most of its ~55 s, so on two CPUs the suite ran in 1,607 s instead of 2,016 s
# (docs/testing.md). --dist loadfile keeps each file on one worker, so a module-scoped
# engine or daemon is started once. PYTEST_WORKERS=0 runs it in one process.
workers="${PYTEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}"
parallel=()
((workers > 0)) && parallel=(-n "$workers" --dist loadfile)

# pytest exits 5 when it collected no test; that is not a failure of the project.
pytest_suite() {
    local rc=0
    # --durations: the slowest tests stay in every CI log (CI time is a budget: < 30 min).
    "$VENV/bin/pytest" -q "${parallel[@]}" --timeout="${PYTEST_TIMEOUT:-900}" --durations=30 \
        "$@" || rc=$?
    ((rc == 5)) && { echo "[test] pytest collected no tests"; return 0; }
    return "$rc"
}

run "ruff" "$VENV/bin/ruff" check .
run "mypy" "$VENV/bin/mypy"
if [[ -f systemd/chandrad.service ]]; then
    # The units name the installed /usr/local/bin/chandrad and chandractl, which verify insists exist:
    # check copies that point at this checkout's venv instead.
    units="$(mktemp -d)"
    trap 'rm -rf "$units"' EXIT
    for unit in systemd/*.service; do
        sed -E "s#/usr/local/bin/(chandrad|chandractl)\b#$VENV/bin/\1#g" "$unit" >"$units/${unit##*/}"
    done
    run "systemd-analyze verify" systemd-analyze verify --man=no "$units"/*.service
    run "systemd-analyze security" \
        systemd-analyze security --offline=yes --no-pager "$units/chandrad.service"
fi
run "pytest" pytest_suite "$@"

if ((${#failed[@]})); then
    printf '[test] FAILED: %s\n' "${failed[*]}"
    exit 1
fi
echo "[test] all checks passed"
