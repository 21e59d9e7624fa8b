//! What a newcomer copies out of the docs must work: every TOML and JSON
//! code block of README.md and docs/*.md, and every admin API request body
//! the docs show, parsed (and, for bodies, sent to a real admin router over
//! TCP) so a doc example can never rot.
//!
//! * A ```toml block is, by its content, an Envoy rules file (`[[rule]]` or
//!   `domain =`: `RulesPolicy`, its rules compiled and a limiter built), a
//!   Cargo.toml snippet (`[dependencies]`, or a `tiered-ratelimit = ...`
//!   line: parsed as TOML, the crate's version and features checked against
//!   this Cargo.toml), or a policy (`Policy::from_toml_str`, then a layer
//!   built from it on the memory backend: `build()` is the one validation).
//! * A ```json block is parsed by serde_json.
//! * An admin API body (`curl ... -d '{...}' .../api/<path>` in a code block,
//!   or a JSON span in a table row or paragraph after `POST /api/<path>`) is
//!   POSTed to that path of a real admin router and must be answered 200.
//! * A block that is deliberately partial says so in its info string
//!   (```` ```toml,ignore ````); the test counts it and skips it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::support::*;
use serde_json::Value;
use tiered_ratelimit::{
    admin, backend::MemoryBackend, descriptor::RulesPolicy, policy::Policy, RateLimitLayer,
};

/// One fenced code block of a Markdown file.
#[derive(Debug)]
struct Block {
    /// `docs/rollout.md:57` (the line of the opening fence, 1-based).
    place: String,
    /// The info string's first word (`toml`, `json`, `sh`, ...).
    lang: String,
    /// The info string's other words (`ignore`, `no_run`, ...).
    flags: Vec<String>,
    /// The block's text, the opening fence's indentation removed.
    text: String,
}

impl Block {
    fn ignored(&self) -> bool {
        self.flags.iter().any(|f| f == "ignore")
    }
}

/// README.md and every docs/*.md, sorted.
fn doc_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

fn relative(path: &Path) -> String {
    path.strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The fenced blocks of one Markdown text (fences of three backticks,
/// possibly indented inside a list item).
fn blocks_of(name: &str, markdown: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, usize, String)> = None; // (line, indent, info)
    let mut text = String::new();
    for (i, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &open {
            None => {
                // CommonMark: a backtick fence's info string holds no
                // backtick (so a line that starts with inline code is no fence).
                let fence = trimmed
                    .strip_prefix("```")
                    .filter(|info| !info.contains('`'));
                if let Some(info) = fence {
                    open = Some((i + 1, indent, info.trim().to_owned()));
                    text.clear();
                }
            }
            Some((start, fence_indent, info)) => {
                if trimmed.starts_with("```") && trimmed.trim() == "```" {
                    let mut words = info.split(',').map(|w| w.trim().to_owned());
                    let lang = words.next().unwrap_or_default();
                    blocks.push(Block {
                        place: format!("{name}:{start}"),
                        lang,
                        flags: words.collect(),
                        text: std::mem::take(&mut text),
                    });
                    open = None;
                } else {
                    let cut = (*fence_indent).min(indent);
                    text.push_str(&line[cut..]);
                    text.push('\n');
                }
            }
        }
    }
    assert!(open.is_none(), "{name}: a code block is never closed");
    blocks
}

fn all_blocks() -> Vec<Block> {
    doc_files()
        .iter()
        .flat_map(|path| {
            let text = std::fs::read_to_string(path).expect("read a doc");
            blocks_of(&relative(path), &text)
        })
        .collect()
}

/// What a ```toml block is, by its content.
#[derive(Debug, PartialEq)]
enum TomlKind {
    Rules,
    Cargo,
    Policy,
}

fn toml_kind(text: &str) -> TomlKind {
    let lines = || {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
    };
    if lines().any(|l| l.starts_with("[[rule]]") || l.starts_with("domain =")) {
        TomlKind::Rules
    } else if lines().any(|l| {
        l.starts_with("[dependencies]")
            || l.starts_with("[dev-dependencies]")
            || l.starts_with("tiered-ratelimit =")
    }) {
        TomlKind::Cargo
    } else {
        TomlKind::Policy
    }
}

/// This crate's version as a Cargo requirement gives it (`0.1`) and its
/// feature names.
fn own_manifest() -> (String, BTreeSet<String>) {
    let text = include_str!("../../Cargo.toml");
    let manifest: toml::Table = toml::from_str(text).expect("Cargo.toml");
    let version = manifest["package"]["version"].as_str().expect("version");
    let short = version.rsplit_once('.').expect("x.y.z").0.to_owned();
    let features = manifest["features"]
        .as_table()
        .expect("[features]")
        .keys()
        .cloned()
        .collect();
    (short, features)
}

/// A Cargo.toml snippet: valid TOML, and a `tiered-ratelimit` dependency in
/// it names this crate's version (or a `path`/`git` source) and only
/// features this crate has.
fn check_cargo(block: &Block) -> Result<(), String> {
    let table: toml::Table = toml::from_str(&block.text).map_err(|e| e.to_string())?;
    let deps = table
        .get("dependencies")
        .and_then(|d| d.as_table())
        .unwrap_or(&table);
    let Some(ours) = deps.get("tiered-ratelimit") else {
        return Ok(());
    };
    let (version, features) = own_manifest();
    let (req, wanted) = match ours {
        toml::Value::String(v) => (Some(v.clone()), Vec::new()),
        toml::Value::Table(t) => {
            if t.get("version").is_none() && t.get("path").is_none() && t.get("git").is_none() {
                return Err("tiered-ratelimit: no version, path or git".into());
            }
            let wanted = t
                .get("features")
                .and_then(|f| f.as_array())
                .map(|a| {
                    a.iter()
                        .map(|f| f.as_str().unwrap_or_default().to_owned())
                        .collect()
                })
                .unwrap_or_default();
            (
                t.get("version").and_then(|v| v.as_str()).map(str::to_owned),
                wanted,
            )
        }
        other => return Err(format!("tiered-ratelimit = {other}: not a dependency")),
    };
    if let Some(req) = req {
        if req != version {
            return Err(format!(
                "tiered-ratelimit version {req:?}, the crate is {version:?}"
            ));
        }
    }
    for f in wanted {
        if !features.contains(&f) {
            return Err(format!("tiered-ratelimit has no feature {f:?}"));
        }
    }
    Ok(())
}

/// The tier added to a policy block that shows only other tables
/// (`[control]`, `[redis]`, lists): a policy needs one to build.
const STAND_IN_TIER: &str =
    "\n[[tier]]\nname = \"docs_stand_in\"\nkey = \"global\"\nlimit = 1\nperiod = \"1s\"\n";

/// A policy: parsed, and a layer built from it on the memory backend (a
/// block of tables without a `[[tier]]` gets [`STAND_IN_TIER`]).
fn check_policy(block: &Block) -> Result<(), String> {
    let has_tier = block
        .text
        .lines()
        .any(|l| l.trim_start().starts_with("[[tier]]"));
    let text = if has_tier {
        block.text.clone()
    } else {
        format!("{}{STAND_IN_TIER}", block.text)
    };
    let policy = Policy::from_toml_str(&text).map_err(|e| format!("parse: {e}"))?;
    RateLimitLayer::from_policy(&policy, MemoryBackend::new())
        .map(drop)
        .map_err(|e| format!("build: {e}"))
}

/// An Envoy rules file: parsed, its rules compiled, a limiter built.
fn check_rules(block: &Block) -> Result<(), String> {
    let rules = RulesPolicy::from_toml_str(&block.text).map_err(|e| format!("parse: {e}"))?;
    rules.rules().map_err(|e| format!("rules: {e}"))?;
    rules
        .limiter(MemoryBackend::new())
        .map(drop)
        .map_err(|e| format!("limiter: {e}"))
}

#[test]
fn every_toml_block_parses() {
    let mut failures = Vec::new();
    let (mut policies, mut rules, mut cargo, mut ignored) = (0, 0, 0, Vec::new());
    for block in all_blocks().iter().filter(|b| b.lang == "toml") {
        if block.ignored() {
            ignored.push(block.place.clone());
            continue;
        }
        let kind = toml_kind(&block.text);
        let result = match kind {
            TomlKind::Rules => {
                rules += 1;
                check_rules(block)
            }
            TomlKind::Cargo => {
                cargo += 1;
                check_cargo(block)
            }
            TomlKind::Policy => {
                policies += 1;
                check_policy(block)
            }
        };
        if let Err(e) = result {
            failures.push(format!("{} ({kind:?}): {e}", block.place));
        }
    }
    println!(
        "toml blocks: {policies} policies, {rules} rules files, {cargo} Cargo.toml snippets, \
         {} marked ignore {ignored:?}",
        ignored.len()
    );
    assert!(
        failures.is_empty(),
        "broken TOML in the docs:\n{}",
        failures.join("\n")
    );
    // The extractor finds what is there (a broken fence parser would find nothing).
    assert!(policies >= 10, "only {policies} policy blocks found");
    assert!(
        rules >= 1,
        "no rules file block found (docs/envoy.md has one)"
    );
    assert!(cargo >= 3, "only {cargo} Cargo.toml blocks found");
}

#[test]
fn every_json_block_parses() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for block in all_blocks().iter().filter(|b| b.lang == "json") {
        if block.ignored() {
            continue;
        }
        checked += 1;
        if let Err(e) = serde_json::from_str::<Value>(&block.text) {
            failures.push(format!("{}: {e}", block.place));
        }
    }
    assert!(
        failures.is_empty(),
        "broken JSON in the docs:\n{}",
        failures.join("\n")
    );
    assert!(checked >= 1, "no ```json block found");
}

/// An admin API request body the docs show: where, the path it is POSTed
/// to (`/api/mode`), the body.
#[derive(Debug)]
struct AdminBody {
    place: String,
    path: String,
    body: String,
}

/// `curl ... -d '<body>' ... /api/<path>` in the code blocks (a command
/// continued with `\` is one command).
fn curl_bodies(block: &Block, out: &mut Vec<AdminBody>) {
    let joined = block.text.replace("\\\n", " ");
    for command in joined.lines().filter(|l| l.contains("curl ")) {
        let Some((_, rest)) = command.split_once("-d '") else {
            continue;
        };
        let Some((body, _)) = rest.split_once('\'') else {
            continue;
        };
        let Some((_, after)) = command.split_once("/admin/ratelimit") else {
            continue;
        };
        let path = after
            .split(|c: char| c.is_whitespace() || c == '\'' || c == '?')
            .next()
            .unwrap_or_default();
        out.push(AdminBody {
            place: block.place.clone(),
            path: path.to_owned(),
            body: body.to_owned(),
        });
    }
}

/// The inline code spans of a text, in order.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Outside code blocks: each table row, or each paragraph, that names
/// `POST /api/<path>`; every inline JSON object after it holding a `tier`
/// or `mode` field is a body of the last `POST` named before it.
fn prose_bodies(name: &str, markdown: &str, out: &mut Vec<AdminBody>) {
    let mut units: Vec<(usize, String)> = Vec::new();
    let mut in_code = false;
    let mut paragraph: Option<(usize, String)> = None;
    for (i, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            in_code = !in_code;
            units.extend(paragraph.take());
            continue;
        }
        if in_code {
            continue;
        }
        if trimmed.starts_with('|') {
            units.extend(paragraph.take());
            units.push((i + 1, line.to_owned()));
        } else if trimmed.is_empty() {
            units.extend(paragraph.take());
        } else {
            let p = paragraph.get_or_insert_with(|| (i + 1, String::new()));
            p.1.push(' ');
            p.1.push_str(trimmed);
        }
    }
    units.extend(paragraph);
    for (line, unit) in units {
        let mut path: Option<String> = None;
        for span in code_spans(&unit) {
            if let Some(p) = span.strip_prefix("POST /api/") {
                path = Some(format!("/api/{p}"));
                continue;
            }
            let Some(path) = &path else { continue };
            let Ok(Value::Object(map)) = serde_json::from_str::<Value>(span) else {
                continue;
            };
            if map.contains_key("tier") || map.contains_key("mode") {
                out.push(AdminBody {
                    place: format!("{name}:{line}"),
                    path: path.clone(),
                    body: span.to_owned(),
                });
            }
        }
    }
}

fn admin_bodies() -> Vec<AdminBody> {
    let mut out = Vec::new();
    for path in doc_files() {
        let name = relative(&path);
        let text = std::fs::read_to_string(&path).expect("read a doc");
        for block in blocks_of(&name, &text) {
            if matches!(block.lang.as_str(), "sh" | "console" | "text" | "") && !block.ignored() {
                curl_bodies(&block, &mut out);
            }
        }
        prose_bodies(&name, &text, &mut out);
    }
    out
}

/// The tiers the docs' bodies name: `ip` (overrides, a penalty box),
/// `user`, `login_ip` (a penalty box).
const ADMIN_POLICY: &str = r#"
[[tier]]
name = "ip"
key = "ip"
limit = 60
period = "1m"
overrides = true
[tier.penalty]
violations = 3
window = "10m"
block = "15m"

[[tier]]
name = "user"
key = "user"
limit = 100
period = "1m"
candidates = [{ limit = 50, period = "1m" }, { limit = 80, period = "1m" }]

[[tier]]
name = "login_ip"
key = "ip"
limit = 5
period = "1m"
methods = ["POST"]
[tier.penalty]
violations = 3
window = "10m"
block = "15m"
"#;

const TOKEN: &str = "docs-examples-admin-token";

#[tokio::test]
async fn every_admin_body_the_docs_show_is_accepted() {
    let bodies = admin_bodies();
    let paths: BTreeSet<&str> = bodies.iter().map(|b| b.path.as_str()).collect();
    println!("{} admin bodies, paths {paths:?}", bodies.len());
    // The docs show bodies of every POST of the admin API.
    for expected in [
        "/api/mode",
        "/api/reset",
        "/api/lift",
        "/api/overrides",
        "/api/overrides/remove",
    ] {
        assert!(
            paths.contains(expected),
            "no body found for {expected}: {bodies:#?}"
        );
    }

    let policy = Policy::from_toml_str(ADMIN_POLICY).unwrap();
    let layer = RateLimitLayer::from_policy(&policy, MemoryBackend::new()).unwrap();
    let router = admin::router(layer.handle(), TOKEN);
    let addr = serve(app(layer).nest("/admin/ratelimit", router)).await;

    let mut failures = Vec::new();
    for b in &bodies {
        // As the docs' curl lines send it: `-d` (a form content type).
        let res = client()
            .post(format!("http://{addr}/admin/ratelimit{}", b.path))
            .bearer_auth(TOKEN)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(b.body.clone())
            .send()
            .await
            .unwrap();
        let status = res.status();
        let answer = res.text().await.unwrap();
        if status != 200 {
            failures.push(format!(
                "{}: POST {} {} -> {status} {answer}",
                b.place, b.path, b.body
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "admin bodies in the docs that the admin API refuses:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_extractor_reads_indented_fences_and_info_strings() {
    let md =
        "text\n\n1. step\n\n   ```toml,ignore\n   a = 1\n     b = 2\n   ```\n\n```` ```toml ```` is inline code\n```json\n{}\n```\n";
    let blocks = blocks_of("x.md", md);
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0].place, "x.md:5");
    assert_eq!(blocks[0].lang, "toml");
    assert!(blocks[0].ignored());
    assert_eq!(blocks[0].text, "a = 1\n  b = 2\n");
    assert_eq!(blocks[1].lang, "json");
    assert!(!blocks[1].ignored());
    assert_eq!(toml_kind("[[rule]]\nname = \"a\"\n"), TomlKind::Rules);
    assert_eq!(toml_kind("tiered-ratelimit = \"0.1\"\n"), TomlKind::Cargo);
    assert_eq!(toml_kind("[[tier]]\nname = \"a\"\n"), TomlKind::Policy);
}

/// Every Markdown page a reader opens: README.md, docs/*.md and the READMEs
/// of the workspace's other crates and of the benchmark lab.
fn pages() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = doc_files();
    for other in ["cli/README.md", "rls/README.md", "perf/README.md"] {
        let path = root.join(other);
        if path.exists() {
            files.push(path);
        }
    }
    files
}

/// The repository paths a Markdown text names (`src/engine/plan.rs`,
/// `lua/`, `perf/load.sh`): words starting with a top-level folder of this
/// repository, with a trailing `#anchor`, `:line` or punctuation removed.
/// Patterns (`*`, `<name>`, `{a,b}`, `…`) are not paths and are skipped.
fn named_paths(markdown: &str) -> Vec<String> {
    const ROOTS: [&str; 10] = [
        "src/",
        "lua/",
        "tests/",
        "perf/",
        "benches/",
        "examples/",
        "rls/",
        "cli/",
        "docs/",
        "fuzz/",
    ];
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_./-*<>{},…".contains(c);
    let mut out = Vec::new();
    for word in markdown.split(|c: char| !is_path_char(c)) {
        let Some(start) = ROOTS.iter().filter_map(|r| word.find(r)).min() else {
            continue;
        };
        // `../docs/x.md` and `(src/x.rs` start at the root folder; a path
        // inside another word (`crates/src/`, `a.src/`) is not ours.
        let before = &word[..start];
        if !(before.is_empty() || before.chars().all(|c| c == '.' || c == '/')) {
            continue;
        }
        let path = word[start..].trim_end_matches(['.', ',', ':']);
        if path.contains(['*', '<', '>', '{', '}', '…']) {
            continue;
        }
        out.push(path.to_string());
    }
    out
}

#[test]
fn every_file_path_the_docs_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("read a page");
        for (i, line) in text.lines().enumerate() {
            for path in named_paths(line) {
                checked += 1;
                // Relative to the repository, or to the crate whose README it is.
                let here = page.parent().unwrap_or(root);
                if !root.join(&path).exists() && !here.join(&path).exists() {
                    missing.push(format!("{}:{}: {path}", relative(&page), i + 1));
                }
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} paths found: is the extractor broken?"
    );
    assert!(
        missing.is_empty(),
        "{} paths named in the docs do not exist:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn the_path_extractor_reads_paths_not_patterns() {
    assert_eq!(
        named_paths("see `src/engine/plan.rs`, (../docs/redis.md#stored) and lua/: the end."),
        ["src/engine/plan.rs", "docs/redis.md", "lua/"]
    );
    assert!(named_paths("`tests/*.rs`, src/backend/<name>.rs, crates/src/x").is_empty());
}
