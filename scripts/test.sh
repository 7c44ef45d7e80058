#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh machine (Python 3.11, Debian), then runs it.
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

# A real etcd server for the name-resolution tests (the tests start it themselves on a loopback port), and
# iproute2 for the multi-host tier (tests/test_multihost.py builds hosts out of network namespaces) and the
# link bench (tc shapes the link between two namespaces).
DEBS=()
command -v etcd >/dev/null 2>&1 || DEBS+=(etcd-server)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || DEBS+=(iproute2)
if [ ${#DEBS[@]} -gt 0 ]; then
    echo "== installing ${DEBS[*]} (Debian packages)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${DEBS[@]}" >/dev/null
fi

# torch==2.13.0 is the CPU build on this kind of machine's disk; a bare `torch` would pull a CUDA build.
echo "== installing the project and its test dependencies"
# The unmaintained `etcd3` 0.12 distribution owns the same module files as its successor python3-etcd3:
# remove it, then put python3-etcd3's files back in case both were installed.
if python -m pip show -q etcd3 >/dev/null 2>&1; then
    python -m pip uninstall -q -y etcd3
    python -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "python3-etcd3>=0.13"
fi
python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[dev]"
# SGLang's real routers for the fleet tests (tests/test_fleet.py), run as processes on CPU: sglang-router and
# its successor gateway smg. pip leaves them alone once these versions are installed.
python -m pip install -q --disable-pip-version-check "sglang-router==0.3.2" "smg==1.13.0"

# Before the SGLang install below (minutes on a fresh machine), so a lint finding fails at once.
echo "== lint (ruff; the rules and why each is chosen: pyproject.toml [tool.ruff])"
python -m ruff check .

# ---- SGLang's own code for the `sglang_code` tier (tests/test_sglang_code.py); owner: the SGLang-tier work.
# Several SGLang releases side by side under $WSYNC_SGLANG_CACHE; a no-op (~10 s) once done, 5-6 min on a fresh machine.
bash scripts/install_sglang.sh
# ---- end of the SGLang block

echo "== running the tests (GPU tests deselected)"
# 'not gpu': tests that need CUDA, NCCL or a real SGLang server run only on GPU hosts.
# Strict mode (tests/conftest.py): a machine that lacks a tier's needs stops the run at once, naming them, and a
# test that skips for a reason outside the short allowlist fails.
# Three workers (pytest-xdist) on 2 cores, a whole file per worker at a time, the longest files first
# (tests/conftest.py): most tests wait on bounds, processes and sockets rather than compute, so a third worker fills
# the waits (docs/testing.md has the figures). `-n 0` (passed on) runs in one process.
export WSYNC_STRICT=1
python -m pytest -m "not gpu" -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder --durations=25 "$@"
