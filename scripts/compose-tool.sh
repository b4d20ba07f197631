#!/usr/bin/env bash
# Make sure a compose tool exists (`docker compose` or Debian's `docker-compose`) to validate
# compose/docker-compose.yml. Idempotent; installs nothing when one is present.
set -euo pipefail
if docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "compose-tool.sh: no compose tool and no apt-get; install docker compose by hand" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends docker-compose
