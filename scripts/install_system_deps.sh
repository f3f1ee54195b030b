#!/usr/bin/env bash
# System packages some tests need, from Debian's apt: `chromium` (the browser test drives it with
# Playwright; `fonts-liberation` keeps its screenshots legible) and `postgresql` (the Postgres
# storage test starts a throwaway server on loopback).
# Safe to run again: when both are installed it only checks and returns (well under a second).
# Without root (or passwordless sudo) or without apt-get it installs nothing, says so, and exits 0;
# the tests that need the missing packages then skip with a reason naming this script.
set -uo pipefail

PACKAGES=(chromium fonts-liberation postgresql)

missing=()
for package in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_system_deps: apt-get not found; not installing ${missing[*]}." \
    "Tests that need them will be skipped." >&2
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "install_system_deps: not root (and no passwordless sudo); not installing ${missing[*]}." \
    "Install them with: sudo apt-get install -y ${missing[*]} -- until then the tests that need them are skipped." >&2
  exit 0
fi

echo "install_system_deps: installing ${missing[*]} with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${SUDO[@]}" apt-get update -qq \
  || ! "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
  echo "install_system_deps: apt-get failed to install ${missing[*]}; the tests that need them will be skipped." >&2
  exit 0
fi
