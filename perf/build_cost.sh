#!/usr/bin/env bash
# What tiered-ratelimit costs an axum app to build: crates added, clean
# release build time and binary size, beside tower_governor.
#
#   perf/build_cost.sh            # from anywhere in the repo; prints a table
#
# Builds four scratch axum "hello world" apps in a temporary directory, one
# run, back to back, each with `cargo build --release` from clean (its own
# target directory, removed once measured):
#   axum             axum alone (the baseline the others are counted against)
#   tower_governor   + tower_governor 0.8 (a per-IP GovernorLayer)
#   memory           + this checkout, default-features = false, features = ["axum"]
#   defaults         + this checkout with its default features
# Each app applies its limiter (a per-IP tier), so the binary holds the
# code a user links. "crates" counts the distinct packages of the app's
# normal dependency graph (`cargo tree -e normal --prefix none | sort -u`)
# minus the axum app's; "compiled" counts the build's `Compiling` lines
# (build scripts and proc macros included). Ratios are to tower_governor.
# Crate counts are exact; times depend on the machine and its load (run it
# on a quiet one). Dependencies are downloaded (`cargo fetch`) before the
# clock starts; CARGO_NET_OFFLINE=true works with a warm registry cache.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work=$(mktemp -d "${TMPDIR:-/tmp}/build_cost.XXXXXX")
trap 'rm -rf "$work"' EXIT
# Each app builds into its own target directory, whatever the caller's.
unset CARGO_TARGET_DIR CARGO_BUILD_TARGET_DIR

# app NAME DEPENDENCY-LINE MAIN-BODY: a scratch crate.
app() {
  local dir="$work/$1"
  mkdir -p "$dir/src"
  cat >"$dir/Cargo.toml" <<EOF
[package]
name = "app_$1"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
axum = "0.8"
tokio = { version = "1", features = ["macros", "rt-multi-thread", "net"] }
$2

[workspace]
EOF
  cat >"$dir/src/main.rs" <<EOF
use axum::{routing::get, Router};
use std::net::SocketAddr;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let app = Router::new().route("/", get(|| async { "hello" }));
    $3
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
EOF
}

ours='let app = app.layer(
        tiered_ratelimit::RateLimitLayer::builder()
            .tier(tiered_ratelimit::Tier::new(
                "ip",
                tiered_ratelimit::key::ClientIp::default(),
                tiered_ratelimit::Quota::per_minute(60),
            ))
            .build()?,
    );'
app axum "" ""
app tower_governor 'tower_governor = "0.8"' 'let conf = tower_governor::governor::GovernorConfigBuilder::default()
        .per_second(1)
        .burst_size(60)
        .finish()
        .ok_or("invalid quota")?;
    let app = app.layer(tower_governor::GovernorLayer::new(conf));'
app memory "tiered-ratelimit = { path = \"$repo\", default-features = false, features = [\"axum\"] }" "$ours"
app defaults "tiered-ratelimit = { path = \"$repo\" }" "$ours"

names=(axum tower_governor memory defaults)
declare -A crates compiled secs bytes
for n in "${names[@]}"; do
  dir="$work/$n"
  (cd "$dir" && cargo fetch -q)
  crates[$n]=$(cd "$dir" && cargo tree -e normal --prefix none | sed 's/ (\*)$//' | sort -u | wc -l)
  echo "building $n ..." >&2
  start=$(date +%s.%N)
  (cd "$dir" && cargo build --release 2>"$dir/build.log") || {
    cat "$dir/build.log" >&2
    exit 1
  }
  end=$(date +%s.%N)
  secs[$n]=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.0f", b - a }')
  compiled[$n]=$(grep -c '^ *Compiling ' "$dir/build.log" || true)
  bytes[$n]=$(stat -c %s "$dir/target/release/app_$n")
  rm -rf "$dir/target"
done

base=${crates[axum]}
gov=tower_governor
printf '| app | crates added | compiled | clean release build | binary |\n'
printf '|---|---|---|---|---|\n'
for n in "${names[@]}"; do
  awk -v n="$n" -v c="${crates[$n]}" -v base="$base" -v k="${compiled[$n]}" \
    -v s="${secs[$n]}" -v b="${bytes[$n]}" -v gc="${crates[$gov]}" \
    -v gs="${secs[$gov]}" -v gb="${bytes[$gov]}" 'BEGIN {
    if (n == "axum" || n == "tower_governor")
      printf "| %s | +%d | %d | %d s | %.2f MB |\n", n, c - base, k, s, b / 1e6
    else
      printf "| %s | +%d (%+d vs tower_governor) | %d | %d s (%.2fx) | %.2f MB (%.2fx) |\n",
        n, c - base, c - gc, k, s, s / gs, b / 1e6, b / gb
  }'
done
