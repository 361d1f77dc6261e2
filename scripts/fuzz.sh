#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each for a bounded time
# (FUZZ_SECONDS, default 30) on its corpus. New inputs that find new
# coverage are written to a scratch copy; crashes fail the run and leave the
# crashing input in build/fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${FUZZ_SECONDS:-30}"
cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
  -DSANDGATE_FUZZ=ON -DSANDGATE_TESTS=OFF >/dev/null
cmake --build build/fuzz -j"$(nproc)" --target frame_fuzz envelope_fuzz virtio_fuzz sse_fuzz api_fuzz dns_fuzz
for t in frame envelope virtio sse api dns; do
  work="build/fuzz/corpus-$t"
  rm -rf "$work" && mkdir -p "$work" && cp tests/fuzz/corpus/$t/* "$work/"
  (cd build/fuzz && "./bin/${t}_fuzz" -max_total_time="$secs" -max_len=70000 "corpus-$t" 2>&1 | tail -3)
done
echo "fuzz: frame, envelope, virtio, sse, api and dns targets ran ${secs} s each without a crash"
