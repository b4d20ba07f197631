#!/usr/bin/env bash
# Make sure a compose tool works (`docker compose` v2 plugin or Debian's `docker-compose`), enough
# to validate compose/docker-compose.yml with `config` (no Docker engine needed for that).
# Idempotent and non-interactive; installs nothing when one already works.
set -euo pipefail

have_tool() {
    docker compose version >/dev/null 2>&1 || docker-compose version >/dev/null 2>&1
}

if have_tool; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "compose-tool.sh: no compose tool and no apt-get; install docker compose by hand" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends docker-compose
if ! have_tool; then
    echo "compose-tool.sh: docker-compose was installed but does not run" >&2
    exit 1
fi
