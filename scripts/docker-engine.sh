#!/usr/bin/env bash
# Make sure a Docker engine binary (dockerd) is installed. Idempotent; installs nothing else.
# The test fixture (tests/integration/docker/conftest.py) starts and stops the daemon itself.
set -euo pipefail

if command -v dockerd >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "docker-engine.sh: dockerd is absent and apt-get is unavailable; install Docker by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends docker.io
command -v dockerd >/dev/null
