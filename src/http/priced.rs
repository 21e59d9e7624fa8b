//! Requests priced by their response, the HTTP side ([`Tier::priced`](crate::Tier::priced)):
//! where the estimate comes from ([`Estimate`]), where the actual cost is
//! read ([`Actual`], [`Usage`]), and when the engine's reservation is
//! settled.
//!
//! At admission a priced tier charges the request's estimate (its cost),
//! all or nothing with the other tiers, in the one backend call. The
//! actual cost is, first found first:
//!
//! 1. what the handler reported through the [`Usage`] handle in the
//!    request's extensions ([`Usage::report`]);
//! 2. the response header named by [`Actual::header`];
//! 3. an HTTP trailer of that name (a stream: read when the body ends).
//!
//! When it is known as the response head comes back (1 or 2), the settle
//! is issued **before** the head goes out, and `X-RateLimit-Remaining` of a
//! priced binding tier shows the tier after it (the admission's number plus
//! `estimate − actual`, at least 0). Otherwise (a stream) the head shows the
//! reservation, and the settle is issued when the body ends. A body that is
//! dropped before its end (client disconnect) or errors **settles at the
//! estimate**: the reservation stands, no call. An actual that is not a
//! whole number counts as unknown (the estimate stands).
//!
//! In memory the settle is applied at once. On Redis (none when the actual
//! equals the estimate) it joins the instance's next batched call, at most
//! one call per 10 ms carrying every settle that arrived meanwhile:
//! awaited before the head goes out when the actual was known at the head
//! (bounded by the backend timeout), in a task of its own at the end of a
//! stream. A call Redis refused
//! (connection down) is retried three times over about 2 s in the
//! background, each attempt bounded by the backend timeout; one that timed
//! out is not (it may have landed); either
//! way a settle that did not land is counted in
//! `tiered_ratelimit_settle_failures_total` and the request stays charged
//! at its estimate. An instance killed before its settles leaves its
//! reservations charged at their estimates; nothing is held for ever.

pub use crate::http::json_body::{JsonBody, JsonBodyFuture, JsonBodyLayer};

use crate::engine::Reservation;
use crate::response::RateLimitHeaders;
use http::{HeaderMap, HeaderName};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where a priced tier's **estimate** (the cost reserved at admission)
/// comes from. Its unit is the tier's: a priced tier's quota counts tokens
/// (say 100 000 per minute), and the estimate is the request's tokens.
#[derive(Clone)]
pub struct Estimate {
    pub(crate) kind: EstimateKind,
    /// [`Estimate::max_body_bytes`], if set.
    body_limit: Option<usize>,
}

#[derive(Clone)]
pub(crate) enum EstimateKind {
    Fixed(u64),
    Header {
        name: String,
        default: u64,
        max: u64,
    },
    Fn(crate::http::tier::CostFn),
    Json {
        field: String,
        default: u64,
        max: u64,
    },
}

impl std::fmt::Debug for Estimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            EstimateKind::Fixed(n) => f.debug_tuple("Estimate::fixed").field(n).finish(),
            EstimateKind::Header { name, default, max } => f
                .debug_struct("Estimate::header")
                .field("name", name)
                .field("default", default)
                .field("max", max)
                .finish(),
            EstimateKind::Fn(_) => f.write_str("Estimate::from_fn(..)"),
            EstimateKind::Json {
                field,
                default,
                max,
            } => f
                .debug_struct("Estimate::json")
                .field("field", field)
                .field("default", default)
                .field("max", max)
                .field("max_body_bytes", &self.body_limit)
                .finish(),
        }
    }
}

impl Estimate {
    /// The same estimate for every request (in the tier's units).
    #[must_use]
    pub fn fixed(cost: u64) -> Self {
        Self {
            kind: EstimateKind::Fixed(cost),
            body_limit: None,
        }
    }

    /// A request header holding a whole number (OpenAI-style
    /// `x-max-tokens`): `default` when it is missing or not a number, and
    /// never more than `max` (a client cannot reserve more than that; 0 is
    /// read as 0, and a request of cost 0 is not checked by the tier).
    /// `build()` refuses an invalid header name, `max` 0 or `default` above
    /// `max`, naming the field.
    #[must_use]
    pub fn header(name: impl Into<String>, default: u64, max: u64) -> Self {
        Self {
            kind: EstimateKind::Header {
                name: name.into(),
                default,
                max,
            },
            body_limit: None,
        }
    }

    /// A whole-number field of the request's JSON body (OpenAI-style
    /// `max_tokens`), at the top level of a JSON object: `default` when the
    /// body is not a JSON object, the field is missing, or it is not a whole
    /// number (`500.0`, `-1`, `"500"`), and never more than `max`, as
    /// [`Estimate::header`].
    ///
    /// The body is read by the layer's companion
    /// [`JsonBodyLayer`](crate::priced::JsonBodyLayer)
    /// ([`RateLimitLayer::json_body`](crate::RateLimitLayer::json_body)),
    /// stacked outside the rate-limit layer: it reads the body up to
    /// [`max_body_bytes`](Estimate::max_body_bytes) (default 2 MiB,
    /// axum's default body limit), answers `413 Payload Too Large` above it,
    /// and hands the handler the body byte for byte as it came. Without the
    /// companion layer in front the body is never read: every request
    /// reserves `max` (never less than it could use), and a `WARN` line
    /// (at most one a second) says the layer is missing.
    ///
    /// `build()` refuses an empty field, `max` 0 or `default` above `max`,
    /// naming the field.
    #[must_use]
    pub fn json(field: impl Into<String>, default: u64, max: u64) -> Self {
        Self {
            kind: EstimateKind::Json {
                field: field.into(),
                default,
                max,
            },
            body_limit: None,
        }
    }

    /// With [`Estimate::json`]: the largest request body read to find the
    /// field, in bytes (default 2 MiB); a larger
    /// body is answered `413 Payload Too Large`. `build()` refuses 0, or a
    /// bound on an estimate that reads no body, naming
    /// `priced.estimate.max_body_bytes`.
    #[must_use]
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.body_limit = Some(bytes);
        self
    }

    /// A function of the request head.
    #[must_use]
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&http::request::Parts) -> u64 + Send + Sync + 'static,
    {
        Self {
            kind: EstimateKind::Fn(Arc::new(f)),
            body_limit: None,
        }
    }

    /// The JSON field this estimate reads and the body bound, if it reads
    /// the body (checked by `build()`).
    fn json_field(
        &self,
        tier: &str,
    ) -> Result<Option<(Box<str>, usize)>, crate::error::ConfigError> {
        let refuse = |field, reason: &str| crate::error::ConfigError::Priced {
            tier: tier.to_owned(),
            field,
            reason: reason.to_owned(),
        };
        match (&self.kind, self.body_limit) {
            (_, Some(0)) => Err(refuse(
                "priced.estimate.max_body_bytes",
                "must be above 0 bytes",
            )),
            (EstimateKind::Json { field, .. }, _) if field.is_empty() => Err(refuse(
                "priced.estimate.json",
                "names no field (an empty name)",
            )),
            (EstimateKind::Json { field, .. }, limit) => Ok(Some((
                field.as_str().into(),
                limit.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            ))),
            (_, Some(_)) => Err(refuse(
                "priced.estimate.max_body_bytes",
                "goes with a json estimate only (no other estimate reads the body)",
            )),
            (_, None) => Ok(None),
        }
    }

    /// The cost function the tier runs (checked by `build()` first).
    pub(crate) fn into_cost_fn(
        self,
        tier: &str,
    ) -> Result<crate::http::tier::CostFn, crate::error::ConfigError> {
        let bounds = |default: u64, max: u64| {
            if max == 0 || default > max {
                return Err(crate::error::ConfigError::Priced {
                    tier: tier.to_owned(),
                    field: "priced.estimate.default",
                    reason: format!("default {default} must be at most max {max}, and max above 0"),
                });
            }
            Ok(())
        };
        Ok(match self.kind {
            EstimateKind::Fixed(n) => Arc::new(move |_: &http::request::Parts| n),
            EstimateKind::Fn(f) => f,
            EstimateKind::Header { name, default, max } => {
                let name = header_name(tier, "priced.estimate.header", &name)?;
                bounds(default, max)?;
                Arc::new(move |p: &http::request::Parts| {
                    whole(p.headers.get(&name)).map_or(default, |n| n.min(max))
                })
            }
            EstimateKind::Json {
                field,
                default,
                max,
            } => {
                bounds(default, max)?;
                crate::http::json_body::cost_fn(field.into(), default, max)
            }
        })
    }
}

/// Where a priced tier's **actual** cost is read once the response is
/// there. The [`Usage`] handle a handler reports through is always read
/// first.
#[derive(Debug, Clone, Default)]
pub struct Actual {
    pub(crate) header: Option<String>,
}

impl Actual {
    /// A response header holding a whole number (`x-usage-tokens`), or, for
    /// a stream, an HTTP trailer of that name.
    #[must_use]
    pub fn header(name: impl Into<String>) -> Self {
        Self {
            header: Some(name.into()),
        }
    }

    /// Only what the handler reports through the [`Usage`] handle.
    #[must_use]
    pub fn reported() -> Self {
        Self { header: None }
    }
}

/// The handle a handler reports a priced request's actual cost through:
/// the layer puts one in the extensions of every request it admitted with
/// a reservation on a priced tier (axum: `Extension<Usage>`). What was last
/// reported when the response head comes back (or, for a stream, when its
/// body ends) is the actual cost of every priced tier of the request.
#[derive(Debug, Clone)]
pub struct Usage(Arc<AtomicU64>);

const UNREPORTED: u64 = u64::MAX;

impl Usage {
    fn new() -> Self {
        Self(Arc::new(AtomicU64::new(UNREPORTED)))
    }

    /// Reports the request's actual cost (in its tiers' units); a later
    /// report replaces an earlier one.
    pub fn report(&self, cost: u64) {
        self.0.store(cost.min(UNREPORTED - 1), Ordering::Relaxed);
    }

    /// What was reported, if anything.
    #[must_use]
    pub fn reported(&self) -> Option<u64> {
        Some(self.0.load(Ordering::Relaxed)).filter(|&n| n != UNREPORTED)
    }
}

/// A header name a priced tier reads, checked by `build()`.
pub(crate) fn header_name(
    tier: &str,
    field: &'static str,
    name: &str,
) -> Result<HeaderName, crate::error::ConfigError> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| crate::error::ConfigError::Priced {
        tier: tier.to_owned(),
        field,
        reason: format!("{name:?} is not a valid header name"),
    })
}

/// A header value as a whole number.
fn whole(v: Option<&http::HeaderValue>) -> Option<u64> {
    v?.to_str().ok()?.trim().parse().ok()
}

/// An admitted request's reservation on its way to its settle: the
/// reservation, the request's [`Usage`] handle, and each tier's actual
/// header (by tier index; `None`: not priced, or reported only).
pub(crate) struct Pricing {
    reservation: Box<Reservation>,
    usage: Usage,
    headers: Arc<[Option<HeaderName>]>,
    /// Actuals found so far, per reserved tier (in the reservation's order).
    found: smallvec::SmallVec<[Option<u64>; 2]>,
}

impl std::fmt::Debug for Pricing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pricing")
            .field("reservation", &self.reservation)
            .field("usage", &self.usage.reported())
            .finish_non_exhaustive()
    }
}

impl Pricing {
    /// The pricing of a request admitted with `reservation`: its [`Usage`]
    /// handle goes into the request's extensions.
    pub(crate) fn start(
        reservation: Box<Reservation>,
        headers: Arc<[Option<HeaderName>]>,
        extensions: &mut http::Extensions,
    ) -> Box<Self> {
        let usage = Usage::new();
        extensions.insert(usage.clone());
        let found = reservation.tiers().iter().map(|_| None).collect();
        Box::new(Self {
            reservation,
            usage,
            headers,
            found,
        })
    }

    /// Reads actuals from `map` (the response's headers, or its trailers)
    /// for the tiers still unknown. Returns whether every tier is known.
    fn read(&mut self, map: &HeaderMap) -> bool {
        let reported = self.usage.reported();
        let mut all = true;
        for (r, found) in self.reservation.tiers().iter().zip(&mut self.found) {
            if found.is_none() {
                *found = reported.or_else(|| {
                    let name = self.headers.get(r.tier)?.as_ref()?;
                    whole(map.get(name))
                });
            }
            all &= found.is_some();
        }
        all
    }

    /// The response head is here: when every actual is known (reported, or
    /// in a header), settles now and corrects the shown headers
    /// ([`AtHead::Settled`], with the Redis call to await before the head
    /// goes out); otherwise the pricing to settle when the body ends.
    pub(crate) fn at_head(
        mut self: Box<Self>,
        head: &HeaderMap,
        shown: Option<&mut RateLimitHeaders>,
    ) -> AtHead {
        if !self.read(head) {
            return AtHead::Later(self);
        }
        if let Some(h) = shown {
            for (r, a) in self.reservation.tiers().iter().zip(&self.found) {
                let Some(a) = *a else { continue };
                // After this request's settle: the admission's number plus
                // what the settle gives back (or less what it charges),
                // between 0 and the limit.
                let after = |remaining: u64, limit: u64| {
                    let back = i128::from(r.estimate) - i128::from(a);
                    let after = (i128::from(remaining) + back).clamp(0, i128::from(limit));
                    u64::try_from(after).unwrap_or(0)
                };
                // A bucket's reset moves by the refill time of what the
                // settle charges (later) or gives back (sooner); a window's
                // stays at the window's end.
                let moved = |reset_us: u64| -> u64 {
                    let Some(us) = r.refill_us(a.abs_diff(r.estimate)) else {
                        return reset_us;
                    };
                    if a >= r.estimate {
                        reset_us.saturating_add(us)
                    } else {
                        reset_us.saturating_sub(us)
                    }
                };
                if *h.policy == *r.name {
                    h.remaining = after(h.remaining, h.limit);
                    let reset_in = moved(h.reset_in.saturating_mul(1_000_000)).div_ceil(1_000_000);
                    if h.window_in == h.reset_in {
                        h.window_in = reset_in;
                    }
                    h.reset = (h.reset + reset_in).saturating_sub(h.reset_in);
                    h.reset_in = reset_in;
                }
                let tokens = h.meters.as_mut().and_then(|m| m.tokens.as_mut());
                if let Some(m) = tokens.filter(|m| *m.policy == *r.name) {
                    m.remaining = after(m.remaining, m.limit);
                    m.reset_ms = moved(m.reset_ms.saturating_mul(1_000)).div_ceil(1_000);
                }
            }
        }
        let (reservation, found) = (*self).into_parts();
        AtHead::Settled(reservation.settle_awaitable(found))
    }

    /// The body sent trailers: actuals still unknown may be in them.
    pub(crate) fn trailers(&mut self, trailers: &HeaderMap) {
        self.read(trailers);
    }

    /// The body ended: settles with what is known (a tier whose actual is
    /// still unknown settles at its estimate).
    pub(crate) fn settle(mut self) {
        self.read(&HeaderMap::new());
        let (reservation, found) = self.into_parts();
        reservation.settle(found);
    }

    /// The reservation, and each tier's actual by tier index.
    fn into_parts(self) -> (Reservation, impl Fn(usize) -> Option<u64>) {
        let Pricing {
            reservation, found, ..
        } = self;
        let tiers: smallvec::SmallVec<[usize; 2]> =
            reservation.tiers().iter().map(|r| r.tier).collect();
        let actual = move |tier| {
            let at = tiers.iter().position(|&t| t == tier)?;
            found.get(at).copied().flatten()
        };
        (*reservation, actual)
    }
}

/// What [`Pricing::at_head`] did.
pub(crate) enum AtHead {
    /// Settled (in memory, or nothing to settle): `None`; or the Redis call
    /// to await before the head goes out.
    Settled(Option<crate::engine::Landing>),
    /// An actual is still unknown: settle when the body ends.
    Later(Box<Pricing>),
}

/// The default of [`Estimate::max_body_bytes`]: 2 MiB, axum's default
/// request body limit.
pub(crate) const DEFAULT_MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// A priced tier's HTTP half, compiled.
pub(crate) struct Compiled {
    /// The actual's header (`None`: reported only).
    pub(crate) actual: Option<HeaderName>,
    /// The JSON body field of its estimate and the body bound, if any.
    pub(crate) json: Option<(Box<str>, usize)>,
}

/// Compiles a priced tier's HTTP half: its estimate becomes the tier's
/// cost function. Not priced: `Ok(None)`. (The engine checks the rest:
/// `engine::check_priced`.)
pub(crate) fn compile(
    t: &mut crate::http::tier::Tier,
) -> Result<Option<Compiled>, crate::error::ConfigError> {
    let Some((estimate, actual)) = t.priced.take() else {
        return Ok(None);
    };
    let json = estimate.json_field(&t.name)?;
    t.cost_fn = Some(estimate.into_cost_fn(&t.name)?);
    let actual = actual
        .header
        .map(|h| header_name(&t.name, "priced.actual.header", &h))
        .transpose()?;
    Ok(Some(Compiled { actual, json }))
}
