//! The replay's settings: [`ReplayOptions`], and the engine and modes it
//! names.

use super::{FieldMap, LogFormat, Target, TimeFormat};

/// Which engine decides requests (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Engine {
    /// `direct`, unless a tier refunds by response status
    /// (`skip_failed_requests` / `skip_successful_requests`): `layer`.
    #[default]
    Auto,
    /// The layer's planning and the memory backend's check, without HTTP:
    /// several times faster, with the same decisions (tested request by
    /// request against `layer`).
    Direct,
    /// A real axum `Router` with the layer, called once per line: the
    /// reference.
    Layer,
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Engine::Auto),
            "direct" => Ok(Engine::Direct),
            "layer" => Ok(Engine::Layer),
            other => Err(format!("unknown engine {other:?} (auto, direct, layer)")),
        }
    }
}

/// How the policy's modes are replayed (`--modes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Modes {
    /// Every tier is enforced (shadow and canary tiers too, and a global
    /// `mode` is ignored), except tiers with `mode = "off"`: what would
    /// happen if the policy were switched on. The default.
    #[default]
    Enforce,
    /// The modes in the file: shadow and not-enforced canary tiers pass
    /// requests and are counted as `shadow_limited`.
    AsConfigured,
}

impl std::str::FromStr for Modes {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "enforce" => Ok(Modes::Enforce),
            "as-configured" | "as_configured" => Ok(Modes::AsConfigured),
            other => Err(format!("unknown modes {other:?} (enforce, as-configured)")),
        }
    }
}

/// What to read and how to replay it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// The log format (default: detected per input).
    pub format: LogFormat,
    /// JSON field names.
    pub fields: FieldMap,
    /// Combined format: what the fields after the user agent are, in order
    /// (nginx's `main` format adds `"$http_x_forwarded_for"`, which is
    /// `Target::Header(x-forwarded-for)`).
    pub extra_fields: Vec<Target>,
    /// How timestamps are written (default: detected per value).
    pub time_format: TimeFormat,
    /// Combined format: use `$remote_user` (the third field) as the user id
    /// (default true; `-` is anonymous).
    pub remote_user: bool,
    /// Route templates in axum syntax (`/users/{id}`, `/static/{*path}`),
    /// for the `endpoint` tier and the per-endpoint report. Paths matching
    /// none are `<unmatched>`.
    pub routes: Vec<String>,
    /// Which engine decides.
    pub engine: Engine,
    /// How modes are replayed.
    pub modes: Modes,
    /// Blocked keys listed per tier (default 10).
    pub top: usize,
    /// Malformed lines listed (default 10).
    pub max_examples: usize,
    /// Show API keys in full instead of masked.
    pub show_keys: bool,
    /// The memory backend's bucket limit (default 1 000 000, as the layer's):
    /// past it, the buckets closest to full are forgotten.
    pub max_keys: usize,
    /// Flush the layer's per-key demand each virtual second, for
    /// [`Replayer::suggest`](crate::replay::Replayer::suggest) (default
    /// false: a replay alone does not pay for it).
    pub demand: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            format: LogFormat::Auto,
            fields: FieldMap::default(),
            extra_fields: Vec::new(),
            time_format: TimeFormat::Auto,
            remote_user: true,
            routes: Vec::new(),
            engine: Engine::Auto,
            modes: Modes::Enforce,
            top: 10,
            max_examples: 10,
            show_keys: false,
            max_keys: 1_000_000,
            demand: false,
        }
    }
}
