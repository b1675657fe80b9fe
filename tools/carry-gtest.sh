#!/usr/bin/env bash
# Copies GoogleTest (Debian's libgtest-dev) into carry/gtest, the git-ignored folder that travels to the
# GPU machine, which has no GoogleTest of its own. Run here before a device run that builds the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f /usr/lib/x86_64-linux-gnu/libgtest.a ]; then
  apt-get update -qq && apt-get install -y -qq libgtest-dev
fi
rm -rf carry/gtest && mkdir -p carry/gtest/include carry/gtest/lib
cp -r /usr/include/gtest carry/gtest/include/
cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a carry/gtest/lib/
echo "carry/gtest ready"
