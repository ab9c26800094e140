#!/usr/bin/env bash
# bubblewrap for the python tool's sandbox (docs/environments.md, "The python tool's sandbox"). Installs it with
# apt-get when this runs as root and `bwrap` is missing (CI); otherwise says what to run. Never fails the build:
# the python tool itself refuses to start without it, naming the fix.
set -u
if command -v bwrap >/dev/null 2>&1; then
    exit 0
fi
if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[bwrap] installing bubblewrap (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >/dev/null 2>&1 \
        || echo "[bwrap] apt-get could not install bubblewrap: the python tool will refuse to start (see docs/environments.md)"
else
    echo "[bwrap] bubblewrap is not installed: the python tool needs it (Debian/Ubuntu: sudo apt-get install bubblewrap;"
    echo "        RHEL/Fedora: sudo dnf install bubblewrap), or set env.kwargs.isolation=none knowingly"
fi
exit 0
