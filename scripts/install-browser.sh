#!/usr/bin/env bash
# The dashboard's tests drive a real headless Chromium. Playwright's own browser download is not used
# (it needs a CDN this project cannot assume); Debian's chromium is installed when missing.
set -euo pipefail
for candidate in "${HOOKLINE_TEST_CHROMIUM:-}" chromium chromium-browser google-chrome; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1; then exit 0; fi
done
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install Chromium (or set HOOKLINE_TEST_CHROMIUM to a Chromium or Chrome binary) to run the dashboard tests" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "Chromium is missing: run 'apt-get install chromium' as root" >&2; exit 1; }
  SUDO="sudo"
fi
echo "installing Debian's chromium for the dashboard tests (log: .venv/chromium.log)"
mkdir -p .venv
{ $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium; } \
  > .venv/chromium.log 2>&1 || { cat .venv/chromium.log >&2; exit 1; }
