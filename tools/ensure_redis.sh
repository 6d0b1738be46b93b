#!/usr/bin/env bash
# The remote-tier tests start real redis-server processes: a machine without one gets it from Debian's packages.
set -euo pipefail
command -v redis-server >/dev/null && exit 0
sudo=""
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
$sudo apt-get update -q
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server
