//! `tiered-ratelimit`: offline tools for the `tiered-ratelimit` crate.
//!
//! `tiered-ratelimit replay --policy policy.toml access.log.gz` replays
//! access logs through a policy and reports the would-be 429s (see
//! `docs/replay.md`).

use clap::{Args, Parser, Subcommand};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use tiered_ratelimit::policy::Policy;
use tiered_ratelimit_cli::replay::{
    write_plot, Engine, FieldMap, Input, LogFormat, Modes, ReplayOptions, Replayer, Target,
    TimeFormat,
};

mod settings;

#[derive(Parser, Debug)]
#[command(
    name = "tiered-ratelimit",
    version,
    about = "Tools for tiered-ratelimit policies and fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay access logs through a policy on a virtual clock and report
    /// the requests it would reject (429), per tier and endpoint.
    Replay(ReplayArgs),
    /// Suggest limits from the per-key demand in access logs (the same
    /// formats as replay): per tier (and plan), the p50/p90/p99/p99.9 of
    /// per-key demand and the smallest limit that denies at most a target
    /// share of keys, as the admin API answers live.
    Suggest(SuggestArgs),
    /// Set, remove or list per-key overrides in a fleet's Redis (the
    /// tier must have `overrides = true` in the policy).
    #[command(subcommand)]
    Override(OverrideCommand),
    /// Set or reset a tier's (or a plan's) quota for the whole fleet (the
    /// policy needs a `[control]` key).
    #[command(subcommand)]
    Quota(settings::QuotaCommand),
    /// Show or change the allow- and denylist for the whole fleet (the
    /// policy needs a `[control]` key).
    #[command(subcommand)]
    Lists(settings::ListsCommand),
}

#[derive(Subcommand, Debug)]
#[command(after_help = "\
Examples:
  tiered-ratelimit override set -p policy.toml --redis redis://10.0.0.5 --tier ip \\
      --key 203.0.113.7 --rule blocked --ttl 1d --by alice
  tiered-ratelimit override set -p policy.toml --redis redis://10.0.0.5 --tier api_key \\
      --key 48fad96717acb36850e4fb9e5b4a975f --rule 10000/1m
  tiered-ratelimit override list -p policy.toml --redis redis://10.0.0.5 --tier ip
  tiered-ratelimit override remove -p policy.toml --redis redis://10.0.0.5 --tier ip --key 203.0.113.7")]
enum OverrideCommand {
    /// Set (or replace) the override of one key.
    Set(OverrideSetArgs),
    /// Remove the override of one key.
    Remove(OverrideKeyArgs),
    /// List a tier's overrides.
    List(OverrideTarget),
}

#[derive(Args, Debug)]
struct OverrideTarget {
    /// The policy (TOML): its key prefix and tiers.
    #[arg(short, long, value_name = "FILE")]
    policy: PathBuf,
    /// The Redis URL; repeat it for a cluster's nodes.
    #[arg(long = "redis", value_name = "URL", required = true)]
    redis: Vec<String>,
    /// The tier.
    #[arg(long)]
    tier: String,
}

#[derive(Args, Debug)]
struct OverrideKeyArgs {
    #[command(flatten)]
    target: OverrideTarget,
    /// The key part as the admin page shows it (`GET /users/{id}`), or as
    /// stored (`GET%20/users/%7Bid%7D`).
    #[arg(long)]
    key: String,
    /// Who makes the change (logged).
    #[arg(long, default_value = "cli")]
    by: String,
}

#[derive(Args, Debug)]
struct OverrideSetArgs {
    #[command(flatten)]
    key: OverrideKeyArgs,
    /// `unlimited`, `blocked`, or a quota `<limit>/<period>` (`10000/1m`,
    /// humantime period).
    #[arg(long)]
    rule: String,
    /// How long it lasts (humantime: `30m`, `7d`); none: until removed.
    #[arg(long)]
    ttl: Option<humantime::Duration>,
}

#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  tiered-ratelimit replay -p policy.toml --route '/users/{id}' access.log access.log.1.gz
  zcat access.log.*.gz | tiered-ratelimit replay -p policy.toml --json - > report.json
  tiered-ratelimit replay -p policy.toml --format json --field ip=client.ip \\
      --field header:x-api-key=api_key --field time=ts --plot 429s.svg app.jsonl

Targets for --field / --extra-field: time, ip, method, path, request, status,
user, plan, header:<name>. See docs/replay.md.")]
struct ReplayArgs {
    #[command(flatten)]
    input: InputArgs,

    /// Blocked keys listed per tier.
    #[arg(long, default_value_t = 10, value_name = "N")]
    top: usize,

    /// Malformed lines listed.
    #[arg(long, default_value_t = 10, value_name = "N")]
    examples: usize,

    /// Show API keys in full (masked by default).
    #[arg(long)]
    show_keys: bool,

    /// Print the report as JSON on stdout instead of tables.
    #[arg(long)]
    json: bool,

    /// Also draw the 429 rate over time per tier to FILE (.svg or .png).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,

    /// No timing line on stderr.
    #[arg(short, long)]
    quiet: bool,
}

/// What replay and suggest read: the policy and the logs, as replay reads them.
#[derive(Args, Debug)]
struct InputArgs {
    /// The policy (TOML, as for `Policy::from_file`).
    #[arg(short, long, value_name = "FILE")]
    policy: PathBuf,

    /// Access logs, replayed in the order given (gzip detected by magic
    /// bytes); `-` or none reads stdin.
    #[arg(value_name = "INPUT")]
    inputs: Vec<String>,

    /// Log format: auto (per input, from its first line), combined, json.
    #[arg(long, default_value = "auto", value_name = "FORMAT")]
    format: LogFormat,

    /// JSON field for a target, `TARGET=FIELD` (dotted for nested objects:
    /// `ip=client.ip`); repeatable. Defaults: time=time, ip=remote_addr,
    /// method=method, path=path, request=request, status=status, user=user.
    #[arg(long = "field", value_name = "TARGET=FIELD")]
    fields: Vec<String>,

    /// Combined format: what the quoted fields after the user agent are, in
    /// order (e.g. `--extra-field header:x-forwarded-for --extra-field
    /// header:x-api-key`); repeatable.
    #[arg(long = "extra-field", value_name = "TARGET")]
    extra_fields: Vec<Target>,

    /// Timestamps: auto, clf, rfc3339, epoch.
    #[arg(long, default_value = "auto", value_name = "FORMAT")]
    time_format: TimeFormat,

    /// Combined format: do not use `$remote_user` as the user id.
    #[arg(long)]
    no_remote_user: bool,

    /// A route template in axum syntax (`/users/{id}`, `/files/{*path}`);
    /// repeatable. Paths matching no route are `<unmatched>`.
    #[arg(short, long = "route", value_name = "PATTERN")]
    routes: Vec<String>,

    /// A file of route templates, one per line (`#` starts a comment).
    #[arg(long, value_name = "FILE")]
    routes_file: Option<PathBuf>,

    /// auto, direct (fast: the layer's planning and the memory backend
    /// without HTTP) or layer (a real axum Router per request).
    #[arg(long, default_value = "auto")]
    engine: Engine,

    /// enforce (every tier not `off` enforced) or as-configured.
    #[arg(long, default_value = "enforce")]
    modes: Modes,

    /// Most buckets kept in memory (as `MemoryBackend::max_keys`).
    #[arg(long, default_value_t = 1_000_000, value_name = "N")]
    max_keys: usize,

    /// No progress bar (it is shown only on a terminal, for large inputs).
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args, Debug)]
#[command(after_help = "\
Examples:
  tiered-ratelimit suggest -p policy.toml access.log access.log.1.gz
  tiered-ratelimit suggest -p policy.toml --tier api_key --target 0.01 --window 24h app.jsonl

The answer is the admin API's `GET /api/suggest/{tier}` (JSON, one per tier
and plan): see docs/rollout.md, \"Which limit? Suggestions\". Nothing is applied.")]
struct SuggestArgs {
    #[command(flatten)]
    input: InputArgs,

    /// Only this tier (default: every tier, and each of its plans).
    #[arg(long)]
    tier: Option<String>,

    /// Only this plan of --tier.
    #[arg(long, requires = "tier")]
    plan: Option<String>,

    /// The share of keys the suggested limit may deny (0 <= target < 1).
    #[arg(long, default_value_t = 0.001)]
    target: f64,

    /// The window read, ending at the log's latest time (humantime, whole
    /// hours, at most 7d).
    #[arg(long, default_value = "7d")]
    window: humantime::Duration,

    /// No timing line on stderr.
    #[arg(short, long)]
    quiet: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => match replay(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tiered-ratelimit replay: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Suggest(args) => match suggest(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tiered-ratelimit suggest: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Quota(c) => match settings::quota_command(c) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tiered-ratelimit quota: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Lists(c) => match settings::lists_command(c) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tiered-ratelimit lists: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Override(c) => match override_command(c) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tiered-ratelimit override: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

/// The handle of a layer built from the policy on the fleet's Redis.
pub(crate) fn fleet_handle(
    policy: &std::path::Path,
    redis: &[String],
) -> Result<tiered_ratelimit::RateLimitHandle, String> {
    use tiered_ratelimit::backend::RedisBackend;
    let policy = Policy::from_file(policy).map_err(|e| e.to_string())?;
    let backend = if redis.len() == 1 {
        RedisBackend::from_url(&redis[0])
    } else {
        RedisBackend::cluster(redis.to_vec())
    }
    .map_err(|e| e.to_string())?;
    let layer = policy
        .builder(backend)
        .and_then(|b| b.build())
        .map_err(|e| e.to_string())?;
    Ok(layer.handle())
}

fn parse_rule(s: &str) -> Result<tiered_ratelimit::handle::Override, String> {
    use tiered_ratelimit::handle::Override;
    match s {
        "unlimited" => Ok(Override::Unlimited),
        "blocked" => Ok(Override::Blocked),
        _ => {
            let (limit, period) = s
                .split_once('/')
                .ok_or_else(|| format!("--rule {s:?}: unlimited, blocked or <limit>/<period>"))?;
            let limit: u64 = limit
                .parse()
                .map_err(|_| format!("--rule {s:?}: the limit is not an integer"))?;
            let period = humantime::parse_duration(period)
                .map_err(|e| format!("--rule {s:?}: the period: {e}"))?;
            Ok(Override::Quota(tiered_ratelimit::Quota::new(limit, period)))
        }
    }
}

fn override_command(c: OverrideCommand) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        match c {
            OverrideCommand::Set(a) => {
                let rule = parse_rule(&a.rule)?;
                let h = fleet_handle(&a.key.target.policy, &a.key.target.redis)?;
                h.set_override(
                    &a.key.target.tier,
                    &a.key.key,
                    rule,
                    a.ttl.map(Into::into),
                    &a.key.by,
                )
                .await
                .map_err(|e| e.to_string())?;
                println!("set {} {}: {rule}", a.key.target.tier, a.key.key);
            }
            OverrideCommand::Remove(a) => {
                let h = fleet_handle(&a.target.policy, &a.target.redis)?;
                let existed = h
                    .remove_override(&a.target.tier, &a.key, &a.by)
                    .await
                    .map_err(|e| e.to_string())?;
                println!(
                    "{} {} {}",
                    if existed { "removed" } else { "no override of" },
                    a.target.tier,
                    a.key
                );
            }
            OverrideCommand::List(t) => {
                let h = fleet_handle(&t.policy, &t.redis)?;
                for e in h.overrides(&t.tier).await.map_err(|e| e.to_string())? {
                    match e.expires_at_us {
                        Some(u) => println!("{}\t{}\texpires_at_us={u}", e.key, e.rule),
                        None => println!("{}\t{}", e.key, e.rule),
                    }
                }
            }
        }
        Ok(())
    })
}

/// The policy, the replay options and the inputs of `args`.
fn read_input(args: &InputArgs) -> Result<(Policy, ReplayOptions, Vec<Input>), String> {
    let policy = Policy::from_file(&args.policy).map_err(|e| e.to_string())?;
    let mut fields = FieldMap::default();
    for f in &args.fields {
        fields
            .set_spec(f)
            .map_err(|e| format!("--field {f}: {e}"))?;
    }
    let mut routes = args.routes.clone();
    if let Some(file) = &args.routes_file {
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if !line.is_empty() {
                routes.push(line.to_owned());
            }
        }
    }
    let mut options = ReplayOptions::default();
    options.format = args.format;
    options.fields = fields;
    options.extra_fields = args.extra_fields.clone();
    options.time_format = args.time_format;
    options.remote_user = !args.no_remote_user;
    options.routes = routes;
    options.engine = args.engine;
    options.modes = args.modes;
    options.max_keys = args.max_keys;
    let inputs: Vec<Input> = if args.inputs.is_empty() {
        vec![Input::Stdin]
    } else {
        args.inputs.iter().map(|a| Input::from_arg(a)).collect()
    };
    Ok((policy, options, inputs))
}

fn replay(args: ReplayArgs) -> Result<(), String> {
    let (policy, mut options, inputs) = read_input(&args.input)?;
    options.top = args.top;
    options.max_examples = args.examples;
    options.show_keys = args.show_keys;
    if let Some(path) = &args.plot {
        // Fail before a long replay, not after it: the chart's file must be
        // writable (it is overwritten at the end).
        std::fs::File::create(path).map_err(|e| format!("--plot {}: {e}", path.display()))?;
    }
    let mut replayer = Replayer::new(&policy, options).map_err(|e| e.to_string())?;
    let start = Instant::now();
    replayer
        .run(&inputs, !args.input.no_progress)
        .map_err(|e| e.to_string())?;
    let elapsed = start.elapsed();
    let engine = replayer.engine();
    let report = replayer.finish();
    if !args.quiet {
        let secs = elapsed.as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let lines = report.input.lines as f64;
        eprintln!(
            "replayed {} lines in {:.3} s: {:.0} lines/s (engine {engine})",
            report.input.lines,
            secs,
            if secs > 0.0 { lines / secs } else { 0.0 },
        );
    }
    let out = if args.json {
        let mut json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        json.push('\n');
        json
    } else {
        report.to_text()
    };
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        // `| head` closing the pipe is not an error.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(format!("stdout: {e}")),
        _ => {}
    }
    // After the report, so a failing chart does not lose it.
    if let Some(path) = &args.plot {
        write_plot(&report, path).map_err(|e| format!("--plot {}: {e}", path.display()))?;
    }
    if report.input.lines == 0 && !report.input.errors.is_empty() {
        return Err("no input could be read (see the report)".into());
    }
    Ok(())
}

/// `tiered-ratelimit suggest`: replays the logs, then answers each tier's
/// (and plan's) suggestion as JSON, an array.
fn suggest(args: SuggestArgs) -> Result<(), String> {
    if !(0.0..1.0).contains(&args.target) {
        return Err(format!("--target {}: at least 0 and below 1", args.target));
    }
    let (policy, mut options, inputs) = read_input(&args.input)?;
    options.demand = true;
    let mut replayer = Replayer::new(&policy, options).map_err(|e| e.to_string())?;
    let start = Instant::now();
    replayer
        .run(&inputs, !args.input.no_progress)
        .map_err(|e| e.to_string())?;
    let asked: Vec<(String, Option<String>)> = match &args.tier {
        Some(t) => vec![(t.clone(), args.plan.clone())],
        None => replayer.tiers_and_plans(),
    };
    let answers: Vec<serde_json::Value> = asked
        .iter()
        .map(|(tier, plan)| {
            match replayer.suggest(tier, plan.as_deref(), args.target, *args.window) {
                Ok(s) => s.to_json(),
                Err(e) => {
                    let mut v = e.to_json();
                    v["tier"] = tier.as_str().into();
                    v["plan"] = plan.as_deref().into();
                    v
                }
            }
        })
        .collect();
    if !args.quiet {
        eprintln!(
            "suggested from the logs in {:.3} s (engine {})",
            start.elapsed().as_secs_f64(),
            replayer.engine()
        );
    }
    let mut out = serde_json::to_string_pretty(&answers).map_err(|e| e.to_string())?;
    out.push('\n');
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("stdout: {e}")),
        _ => Ok(()),
    }
}
