#!/usr/bin/env bash
# Runs every cargo-fuzz target in this directory for a bounded time each.
#
#   fuzz/run.sh                      # every target, 60 s each
#   FUZZ_SECONDS=300 fuzz/run.sh     # longer
#   fuzz/run.sh storage_key          # some targets only
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). libFuzzer's -Z flags need a
# nightly compiler: `cargo +nightly` is used when a nightly toolchain is
# installed, otherwise the stable one with RUSTC_BOOTSTRAP=1 (which unlocks
# nightly flags on a stable compiler; fine for a fuzzing build, never for a
# release). FUZZ_TARGET_DIR overrides the build directory (default
# fuzz/target). Corpora grow in fuzz/corpus/<target> (git-ignored), seeded
# from fuzz/seeds/<target>; crashes land in fuzz/artifacts/<target> and make
# this script exit non-zero. Not run by `cargo test` or CI.
set -euo pipefail
cd "$(dirname "$0")"

seconds="${FUZZ_SECONDS:-60}"
target_dir="${FUZZ_TARGET_DIR:-$PWD/target}"

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
  exit 2
fi
if cargo +nightly --version >/dev/null 2>&1; then
  toolchain=(+nightly)
  echo "toolchain: $(cargo +nightly --version)"
else
  toolchain=()
  export RUSTC_BOOTSTRAP=1
  echo "toolchain: $(cargo --version) with RUSTC_BOOTSTRAP=1"
fi

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo "${toolchain[@]}" fuzz list)
fi

echo "building (the first build takes a few minutes: std is rebuilt with ASan)"
cargo "${toolchain[@]}" fuzz build --target-dir "$target_dir"

status=0
summary=()
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  log="artifacts/$t/last-run.log"
  echo "== $t: ${seconds}s"
  if cargo "${toolchain[@]}" fuzz run --target-dir "$target_dir" "$t" "corpus/$t" "${seeds[@]}" -- \
      -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    status=1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 || true)
  corpus=$(find "corpus/$t" -type f | wc -l)
  line="$t: $result, ${runs:-?} runs in ${seconds}s, ${cov:-cov: ?}, corpus $corpus files"
  echo "$line"
  summary+=("$line")
  if [ "$result" = FAILED ]; then
    tail -40 "$log"
  fi
done

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$status"
