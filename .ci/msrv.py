#!/usr/bin/env python3
"""The declared MSRV holds for the lock file: for each published crate of the
workspace, every package it builds with its default features (normal and
build dependencies, on Linux, through the lock file) declares a `rust-version` no newer than the
crate's own. Only the installed toolchain can be had on this machine, so the
compiler itself cannot be run at the MSRV; this check and clippy's
`incompatible_msrv` lint (standard library items newer than the declared
`rust-version`, run by `cargo clippy` in .ci/run) are what is verified.

Reads `cargo metadata`; exits 1 naming each offending package.
"""
import json
import subprocess
import sys


def version(text):
    return tuple(int(x) for x in text.split(".")[:3]) + (0,) * (3 - len(text.split(".")))


def main():
    meta = json.loads(
        subprocess.check_output(
            [
                "cargo",
                "metadata",
                "--format-version",
                "1",
                "--locked",
                "--filter-platform",
                "x86_64-unknown-linux-gnu",
            ]
        )
    )
    by_name_version = {(p["name"], p["version"]): p for p in meta["packages"]}
    failures = []
    checked = 0
    for member in meta["workspace_members"]:
        crate = next(p for p in meta["packages"] if p["id"] == member)
        if crate.get("publish") == []:
            continue
        msrv = crate.get("rust_version")
        if not msrv:
            failures.append(f"{crate['name']}: no rust-version declared")
            continue
        # What `cargo build -p <crate>` builds: its default features only
        # (cargo metadata's graph unifies the features of the whole
        # workspace; `cargo tree -p` resolves them as a build of one crate).
        tree = subprocess.check_output(
            [
                "cargo",
                "tree",
                "--locked",
                "-p",
                crate["name"],
                "-e",
                "normal,build",
                "--target",
                "x86_64-unknown-linux-gnu",
                "--prefix",
                "none",
                "--no-dedupe",
                "-f",
                "{p}",
            ],
            text=True,
        )
        seen = set()
        for line in tree.splitlines():
            parts = line.split()
            if len(parts) < 2 or not parts[1].startswith("v"):
                continue
            seen.add((parts[0], parts[1][1:]))
        for key in sorted(seen):
            p = by_name_version.get(key)
            if p is None or p["id"] == member:
                continue
            checked += 1
            needs = p.get("rust_version")
            if needs and version(needs) > version(msrv):
                failures.append(
                    f"{crate['name']} (rust-version {msrv}) builds {p['name']} "
                    f"{p['version']}, which needs Rust {needs}"
                )
        print(f"msrv: {crate['name']} {msrv}: {len(seen) - 1} dependencies checked")
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)
    if checked == 0:
        sys.exit("msrv: no dependency checked")


if __name__ == "__main__":
    main()
