#!/bin/sh
# Debian's Chromium for the browser tests (tests/test_web_page.py drives it with
# Playwright; no browser is ever downloaded). Installed with apt-get where this runs as
# root on Debian or Ubuntu; elsewhere those tests skip, saying why. Never fails the set-up.
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq chromium >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; } \
        || echo "chromium could not be installed: the browser tests will skip"
else
    echo "no chromium (install Debian's chromium package to run the browser tests; they skip without it)"
fi
exit 0
