#!/usr/bin/env bash
# The library's public face, counted from its rustdoc: public modules, named
# items, and second paths to one item.
#
#   perf/public_face.sh           # from anywhere in the repo; builds the docs
#   perf/public_face.sh --list    # the same, and every module, item and second path
#
# Builds `cargo doc --no-deps -p tiered-ratelimit` with the features docs.rs
# shows (Cargo.toml's [package.metadata.docs.rs], `document-features` aside:
# it adds no item), then reads target/doc/tiered_ratelimit/:
#   modules       every public module (the Modules sections of the module
#                 pages, walked from the crate root's; the root not counted)
#   items         every named item (all.html: structs, enums, traits,
#                 functions, type aliases, constants, macros), each once
#                 (items are told apart by their source location, so an
#                 item rustdoc inlines at two paths counts once)
#   second paths  every path to an item beyond its first: an item page
#                 rustdoc wrote twice (a private item re-exported at two
#                 public paths), plus every `pub use` line a module page
#                 shows for an item of this crate (a public item re-exported
#                 elsewhere); the root's are listed apart, since the crate
#                 docs' "One path per type" section documents them
# Methods and fields are not counted. The figures are exact for the tree
# they are run on; they do not depend on the machine.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
list=${1:-}
target="${CARGO_TARGET_DIR:-$repo/target}"
features=redis,axum,admin,calendar,policy-file,grpc,envoy-yaml
cargo doc --no-deps -q -p tiered-ratelimit --features "$features" >&2
doc="$target/doc/tiered_ratelimit"
python3 - "$doc" "$list" <<'PY'
import html, os, re, sys
doc, listing = sys.argv[1], sys.argv[2] == "--list"

def read(page):
    return open(os.path.join(doc, page), encoding="utf-8").read()

def section(text, name):
    """A module page's section (`modules`, `reexports`, ...), or ''."""
    m = re.search(r'<h2 id="%s".*?(?=<h2 |</section>)' % name, text, re.S)
    return m.group(0) if m else ""

# The module tree, walked from the crate root's page (so pages a former
# build left behind, and rustdoc's redirect pages, are not counted).
modules, todo = [], [""]
while todo:
    module = todo.pop()
    text = read(os.path.join(module, "index.html"))
    for sub in re.findall(r'<a class="mod" href="([^"]+)/index.html"', section(text, "modules")):
        path = os.path.normpath(os.path.join(module, sub))
        modules.append(path)
        todo.append(path)
modules = sorted(m.replace(os.sep, "::") for m in modules)

all_html = read("all.html")
pages = sorted(set(re.findall(r'<li><a href="([^"]+\.html)">', all_html)))

def source_of(page):
    text = read(page)
    m = re.search(r'<a class="src" href="([^"]+)"', text)
    return m.group(1).split("/src/", 1)[-1] if m else page

def path_of(page):
    parts = page[: -len(".html")].split("/")
    return "::".join(parts[:-1] + [parts[-1].split(".", 1)[1]])

by_source = {}
for page in pages:
    by_source.setdefault(source_of(page), []).append(path_of(page))
inlined_twice = {src: sorted(p) for src, p in by_source.items() if len(p) > 1}

reexports = []  # (module, item path)
for module in [""] + modules:
    text = read(os.path.join(module.replace("::", os.sep), "index.html"))
    for dt in re.findall(r'<dt id="reexport\.[^"]*">(.*?)</dt>', section(text, "reexports"), re.S):
        m = re.search(r'title="[a-z]+ (tiered_ratelimit::[^"]+)"', dt)
        if m:  # an item of this crate (not an external crate's re-export)
            reexports.append((module or "(root)", html.unescape(m.group(1))))

extra_pages = sum(len(p) - 1 for p in inlined_twice.values())
root = [r for r in reexports if r[0] == "(root)"]
other = [r for r in reexports if r[0] != "(root)"]
print(f"public modules: {len(modules)}")
print(f"named items:    {len(by_source)} ({len(pages)} item pages)")
print(f"second paths:   {extra_pages + len(reexports)} "
      f"({extra_pages} items inlined at two paths, {len(root)} root re-exports "
      f"of public items, {len(other)} re-exports elsewhere)")
if listing:
    print("\nmodules:")
    for m in modules:
        print("  " + m)
    print("\nitems:")
    for src, paths in sorted(by_source.items(), key=lambda kv: kv[1]):
        print("  " + " = ".join(paths))
    print("\nitems inlined at two paths:")
    for paths in sorted(inlined_twice.values()):
        print("  " + " = ".join(paths))
    print("\nre-exports of public items (module: item):")
    for module, item in reexports:
        print(f"  {module}: {item}")
PY
