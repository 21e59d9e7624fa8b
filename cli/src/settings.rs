//! `tiered-ratelimit quota` and `tiered-ratelimit lists`: a fleet's
//! quotas and lists, written as fleet-wide settings beside its control key.

use crate::fleet_handle;
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
#[command(after_help = "\
Examples:
  tiered-ratelimit quota set -p policy.toml --redis redis://10.0.0.5 --tier user \\
      --limit 200 --period 1m --by alice
  tiered-ratelimit quota set -p policy.toml --redis redis://10.0.0.5 --tier user --plan pro \\
      --limit 2000 --period 1m --burst 3000
  tiered-ratelimit quota set -p policy.toml --redis redis://10.0.0.5 --tier monthly \\
      --limit 50000 --period month
  tiered-ratelimit quota reset -p policy.toml --redis redis://10.0.0.5 --tier user")]
pub(crate) enum QuotaCommand {
    /// Set the quota (fleet-wide settings: every instance within one poll).
    Set(QuotaSetArgs),
    /// Back to the configured quota.
    Reset(QuotaResetArgs),
}

#[derive(Args, Debug)]
pub(crate) struct FleetTarget {
    /// The policy (TOML): its key prefix, tiers and `[control]` key.
    #[arg(short, long, value_name = "FILE")]
    policy: PathBuf,
    /// The Redis URL; repeat it for a cluster's nodes.
    #[arg(long = "redis", value_name = "URL", required = true)]
    redis: Vec<String>,
    /// Who makes the change (stored with it and logged).
    #[arg(long, default_value = "cli")]
    by: String,
}

#[derive(Args, Debug)]
pub(crate) struct QuotaResetArgs {
    #[command(flatten)]
    target: FleetTarget,
    /// The tier.
    #[arg(long)]
    tier: String,
    /// A plan of the tier (none: the tier's own quota).
    #[arg(long)]
    plan: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct QuotaSetArgs {
    #[command(flatten)]
    reset: QuotaResetArgs,
    /// Requests (or cost units) per period.
    #[arg(long)]
    limit: u64,
    /// A duration (`1m`, humantime), or a calendar tier's own period
    /// (`month`).
    #[arg(long)]
    period: String,
    /// The burst (algorithms that have one).
    #[arg(long)]
    burst: Option<u64>,
}

#[derive(Subcommand, Debug)]
#[command(after_help = "\
Examples:
  tiered-ratelimit lists show -p policy.toml --redis redis://10.0.0.5
  tiered-ratelimit lists add -p policy.toml --redis redis://10.0.0.5 --list deny \\
      --ip 203.0.113.0/24 --user mallory
  tiered-ratelimit lists remove -p policy.toml --redis redis://10.0.0.5 --list deny --ip 203.0.113.0/24")]
pub(crate) enum ListsCommand {
    /// The entries in force (the fleet-wide settings', else the policy's).
    Show(FleetTarget),
    /// Add entries to a list.
    Add(ListsChangeArgs),
    /// Remove entries from a list.
    Remove(ListsChangeArgs),
}

#[derive(Args, Debug)]
pub(crate) struct ListsChangeArgs {
    #[command(flatten)]
    target: FleetTarget,
    /// `allow` or `deny`.
    #[arg(long)]
    list: String,
    /// A network or address; repeatable.
    #[arg(long = "ip")]
    ips: Vec<String>,
    /// A user id; repeatable.
    #[arg(long = "user")]
    users: Vec<String>,
    /// An API key; repeatable.
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
}

/// A handle on the fleet of `t` (its policy, its Redis), with the stored
/// settings read.
async fn settings_handle(t: &FleetTarget) -> Result<tiered_ratelimit::RateLimitHandle, String> {
    let h = fleet_handle(&t.policy, &t.redis)?;
    if h.fleet_control_key().is_none() {
        return Err(format!(
            "{}: no [control] key: quotas and lists are fleet-wide settings only with one",
            t.policy.display()
        ));
    }
    h.ready().await;
    Ok(h)
}

fn current_thread() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

pub(crate) fn quota_command(c: QuotaCommand) -> Result<(), String> {
    current_thread()?.block_on(async {
        let version = match &c {
            QuotaCommand::Set(a) => {
                let r = &a.reset;
                let h = settings_handle(&r.target).await?;
                let tier = h
                    .tiers()
                    .into_iter()
                    .find(|t| t.name == r.tier)
                    .ok_or_else(|| format!("--tier: no tier {:?} in the policy", r.tier))?;
                // A calendar tier keeps its calendar (whose nominal length
                // its quota carries): only the limit and burst change.
                let named = tiered_ratelimit::algorithm::CalendarPeriod::from_name(&a.period);
                let period = match (tier.calendar, named) {
                    (Some(own), Some(p)) if own == p => tier.quota.period(),
                    (Some(own), _) => {
                        return Err(format!(
                            "period: tier {:?} is a calendar quota: its period is {:?}",
                            r.tier,
                            own.name()
                        ))
                    }
                    (None, Some(p)) => {
                        return Err(format!(
                            "period: {:?} is a calendar period, and tier {:?} is not a calendar quota: give a duration (\"1m\")",
                            p.name(),
                            r.tier
                        ))
                    }
                    (None, None) => humantime::parse_duration(&a.period)
                        .map_err(|e| format!("period: {:?}: {e}", a.period))?,
                };
                let mut quota = tiered_ratelimit::Quota::new(a.limit, period);
                if let Some(b) = a.burst {
                    quota = quota.burst(b);
                }
                h.set_fleet_quota(&r.tier, r.plan.as_deref(), quota, &r.target.by)
                    .await
            }
            QuotaCommand::Reset(r) => {
                let h = settings_handle(&r.target).await?;
                h.reset_fleet_quota(&r.tier, r.plan.as_deref(), &r.target.by)
                    .await
            }
        }
        .map_err(|e| e.to_string())?;
        println!("settings version {version}");
        Ok(())
    })
}

pub(crate) fn lists_command(c: ListsCommand) -> Result<(), String> {
    use tiered_ratelimit::rollout::{ListEntries, ListKind};
    current_thread()?.block_on(async {
        let (a, add) = match c {
            ListsCommand::Show(t) => {
                let h = settings_handle(&t).await?;
                let json = serde_json::json!({
                    "allow": h.allowlist_entries(),
                    "deny": h.denylist_entries(),
                    "settings_version": h.settings_version(),
                });
                println!("{json}");
                return Ok(());
            }
            ListsCommand::Add(a) => (a, true),
            ListsCommand::Remove(a) => (a, false),
        };
        let kind = match a.list.as_str() {
            "allow" => ListKind::Allow,
            "deny" => ListKind::Deny,
            other => return Err(format!("--list {other:?}: allow or deny")),
        };
        let mut entries = ListEntries::default();
        entries.ips = a.ips;
        entries.users = a.users;
        entries.api_keys = a.api_keys;
        let h = settings_handle(&a.target).await?;
        let none = ListEntries::default();
        let (add, remove) = if add {
            (&entries, &none)
        } else {
            (&none, &entries)
        };
        let version = h
            .change_fleet_list(kind, add, remove, &a.target.by)
            .await
            .map_err(|e| e.to_string())?;
        println!("settings version {version}");
        Ok(())
    })
}
