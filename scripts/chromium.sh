#!/usr/bin/env bash
# Make sure Debian's chromium is installed (the browser tests in tests/browser drive it headless).
# Idempotent and quiet; runs as root without a terminal, or through sudo otherwise.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium.sh: /usr/bin/chromium is absent and apt-get is unavailable; install it by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq </dev/null >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends chromium </dev/null >/dev/null
test -x /usr/bin/chromium
