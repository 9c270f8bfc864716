#!/bin/sh
# Installs the pinned agent clients that tests/test_agent_clients.py runs (and ollama-js,
# which tests/test_ollama.py runs): the Node ones from package-lock.json where npm exists (the tests skip them, saying so, elsewhere), and
# Aider in its own virtual environment (.aider-venv), because its exact pins conflict
# with the test extras. A second run reuses the Aider environment.
set -e
cd "$(dirname "$0")"
if command -v npm >/dev/null 2>&1; then
    npm ci --no-audit --no-fund --loglevel=error
    # the Open Responses compliance suite's runtime (Bun, 400 MB), only where a checkout of the
    # suite is named (bench/openresponses_suite.py; tests/test_openresponses_suite.py skips elsewhere)
    if [ -n "$OPENRESPONSES_CHECKOUT" ]; then
        (cd openresponses && npm ci --no-audit --no-fund --loglevel=error)
    fi
else
    echo "npm not found: the Node clients' tests will skip"
fi
[ -x .aider-venv/bin/python ] || python -m venv .aider-venv
.aider-venv/bin/python -m pip install -q --disable-pip-version-check -r aider-requirements.txt
