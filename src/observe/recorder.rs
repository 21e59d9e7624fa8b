//! Per-request bookkeeping for the operator: 429 counts per (tier, endpoint)
//! in time buckets feeding the anomaly baseline and the per-minute history,
//! and the top-N sketches. All of it in this process, without a backend call.

use super::anomaly::{AnomalyConfig, Baseline, Transition};
use super::topn::{BlockedKey, Kind, TierSketch};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Minutes of history kept for the admin page.
pub(crate) const HISTORY_BUCKETS: usize = 60;

/// Counts of one tier in one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BucketCounts {
    /// Start of the bucket, Unix epoch seconds.
    pub start: u64,
    /// Requests this tier checked.
    pub requests: u64,
    /// Of those, rejected by this tier (enforced).
    pub limited: u64,
    /// Of those, would have been rejected (shadow).
    pub shadow_limited: u64,
    /// Requests this tier would have checked that passed unchecked: the
    /// backend could not decide and the failure policy let them through
    /// (fail open). Not in `requests`.
    pub fail_open: u64,
}

/// One (tier, endpoint) series of the anomaly baseline.
#[derive(Debug, Clone, PartialEq)]
pub struct AnomalyStatus {
    /// The tier.
    pub tier: String,
    /// The endpoint (`GET /users/{id}`).
    pub endpoint: String,
    /// Whether the alert is raised.
    pub alerting: bool,
    /// The last finished bucket's 429 rate (0-1).
    pub rate: f64,
    /// The baseline mean (0-1).
    pub mean: f64,
    /// The baseline standard deviation.
    pub sigma: f64,
}

/// One thread's counts of one series' open bucket.
#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    limited: AtomicU64,
    shadow_limited: AtomicU64,
    fail_open: AtomicU64,
}

impl Counters {
    /// `[requests, limited, shadow_limited, fail_open]`, each read by `f`.
    fn read(&self, f: &impl Fn(&AtomicU64) -> u64) -> [u64; 4] {
        [
            f(&self.requests),
            f(&self.limited),
            f(&self.shadow_limited),
            f(&self.fail_open),
        ]
    }
}

/// An endpoint's open-bucket counts: for each thread that counts, a row of
/// [`Counters`], one per tier, allocated by that thread (`thread_local`'s
/// per-thread slots). A request adds to its own thread's row only, so no
/// cache line is written by two workers; the roll takes every thread's
/// (swapped to 0).
struct ByThread {
    tiers: usize,
    rows: thread_local::ThreadLocal<Box<[Counters]>>,
}

impl ByThread {
    fn new(tiers: usize) -> Self {
        Self {
            tiers,
            rows: thread_local::ThreadLocal::new(),
        }
    }

    /// This thread's counters of `tier`.
    #[inline]
    fn mine(&self, tier: usize) -> Option<&Counters> {
        self.rows
            .get_or(|| (0..self.tiers).map(|_| Counters::default()).collect())
            .get(tier)
    }

    /// Every thread's counts of `tier` summed, each read by `f` (`swap(0)`
    /// to take them, `load` to look).
    fn sum(&self, tier: usize, f: impl Fn(&AtomicU64) -> u64) -> [u64; 4] {
        let mut total = [0; 4];
        for c in self.rows.iter().filter_map(|row| row.get(tier)) {
            for (t, n) in total.iter_mut().zip(c.read(&f)) {
                *t += n;
            }
        }
        total
    }
}

struct Series {
    baseline: Mutex<Baseline>,
}

/// The series of one endpoint, one per tier; looked up once per request.
pub(crate) struct Endpoint {
    pub(crate) name: Arc<str>,
    /// Dense, in creation order: below the observer's endpoint cap + 1.
    pub(crate) id: usize,
    series: Box<[Series]>,
    counts: ByThread,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

thread_local! {
    static LABEL: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    /// The endpoint this thread looked up last: its observer's id, method,
    /// route and series. Most requests a thread serves in a row share their
    /// route, so this answers them without building the label or hashing it.
    static LAST_ENDPOINT: std::cell::RefCell<Option<LastEndpoint>> =
        const { std::cell::RefCell::new(None) };
}

/// [`LAST_ENDPOINT`]'s entry.
struct LastEndpoint {
    observer: u64,
    method: String,
    route: String,
    endpoint: Arc<Endpoint>,
}

/// Distinct ids of observers, for [`LAST_ENDPOINT`] (an address could be
/// reused by a later observer).
static NEXT_OBSERVER_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct Observer {
    /// Unique in this process.
    id: u64,
    tiers: Box<[Arc<str>]>,
    config: AnomalyConfig,
    /// endpoint → one series per tier. Read by every request without a
    /// lock (a new endpoint, at most `max_endpoints` times, copies the map
    /// under `adding`).
    series: arc_swap::ArcSwap<EndpointMap>,
    adding: Mutex<()>,
    max_endpoints: usize,
    bucket: AtomicU64,
    roll: Mutex<()>,
    history: Mutex<Vec<VecDeque<BucketCounts>>>,
    sketches: Box<[TierSketch]>,
}

/// Endpoint label → its series (foldhash: the lookup is per request).
type EndpointMap = HashMap<Arc<str>, Arc<Endpoint>, foldhash::fast::RandomState>;

/// The default of the most distinct endpoints tracked; more share `<other>`.
pub(crate) const DEFAULT_MAX_ENDPOINTS: usize = 1024;

/// The endpoint label of requests past the endpoint cap.
pub(crate) const OTHER_ENDPOINT: &str = "<other>";

impl Observer {
    /// `max_endpoints`: distinct endpoint labels before new ones share
    /// [`OTHER_ENDPOINT`] (at least 1).
    pub(crate) fn new(
        tiers: Vec<Arc<str>>,
        config: AnomalyConfig,
        sketch_capacity: usize,
        max_endpoints: usize,
    ) -> Self {
        let n = tiers.len();
        Self {
            id: NEXT_OBSERVER_ID.fetch_add(1, Ordering::Relaxed),
            sketches: (0..n).map(|_| TierSketch::new(sketch_capacity)).collect(),
            history: Mutex::new(vec![VecDeque::new(); n]),
            tiers: tiers.into_boxed_slice(),
            config,
            series: arc_swap::ArcSwap::from_pointee(EndpointMap::default()),
            adding: Mutex::new(()),
            max_endpoints: max_endpoints.max(1),
            bucket: AtomicU64::new(0),
            roll: Mutex::new(()),
        }
    }

    /// The series of `METHOD route`, without allocating when it exists.
    /// A label's series never changes once looked up (the map only grows,
    /// and a label past the cap stays `<other>`), so the thread's last
    /// answer is reused while the method and route repeat.
    pub(crate) fn endpoint(&self, method: &str, route: &str) -> Arc<Endpoint> {
        let cached = LAST_ENDPOINT.try_with(|last| {
            let last = last.try_borrow().ok()?;
            let l = last.as_ref()?;
            (l.observer == self.id && l.method == method && l.route == route)
                .then(|| l.endpoint.clone())
        });
        if let Ok(Some(e)) = cached {
            return e;
        }
        let e = LABEL.with(|buf| {
            let mut label = buf.borrow_mut();
            label.clear();
            label.push_str(method);
            label.push(' ');
            label.push_str(route);
            self.endpoint_named(&label)
        });
        let _ = LAST_ENDPOINT.try_with(|last| {
            let Ok(mut last) = last.try_borrow_mut() else {
                return;
            };
            // The strings' buffers are kept from one entry to the next.
            let (mut m, mut r) = match last.take() {
                Some(l) => (l.method, l.route),
                None => (String::new(), String::new()),
            };
            m.clear();
            m.push_str(method);
            r.clear();
            r.push_str(route);
            *last = Some(LastEndpoint {
                observer: self.id,
                method: m,
                route: r,
                endpoint: e.clone(),
            });
        });
        e
    }

    fn endpoint_named(&self, label: &str) -> Arc<Endpoint> {
        {
            let map = self.series.load();
            if let Some(e) = map.get(label) {
                return e.clone();
            }
            // Full: new labels share `<other>`, without taking the lock.
            if map.len() >= self.max_endpoints {
                if let Some(e) = map.get(OTHER_ENDPOINT) {
                    return e.clone();
                }
            }
        }
        let _adding = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        let mut map = EndpointMap::clone(&self.series.load());
        let label = if map.len() >= self.max_endpoints && !map.contains_key(label) {
            OTHER_ENDPOINT
        } else {
            label
        };
        if let Some(e) = map.get(label) {
            return e.clone();
        }
        let name: Arc<str> = Arc::from(label);
        let e = Arc::new(Endpoint {
            name: name.clone(),
            // The map only grows, to at most max_endpoints + 1 (`<other>`).
            id: map.len(),
            series: self
                .tiers
                .iter()
                .map(|_| Series {
                    baseline: Mutex::new(Baseline::default()),
                })
                .collect(),
            counts: ByThread::new(self.tiers.len()),
        });
        map.insert(name, e.clone());
        self.series.store(Arc::new(map));
        e
    }

    /// Records one tier's decision for a request on `endpoint`.
    pub(crate) fn record(
        &self,
        endpoint: &Endpoint,
        tier: usize,
        limited: bool,
        shadow_limited: bool,
        now_s: u64,
    ) {
        self.roll(now_s);
        self.record_rolled(endpoint, tier, limited, shadow_limited);
    }

    /// [`record`](Self::record) without closing the bucket: the caller
    /// called [`roll`](Self::roll) for this request's time.
    #[inline]
    pub(crate) fn record_rolled(
        &self,
        endpoint: &Endpoint,
        tier: usize,
        limited: bool,
        shadow_limited: bool,
    ) {
        if let Some(c) = endpoint.counts.mine(tier) {
            c.requests.fetch_add(1, Ordering::Relaxed);
            if limited {
                c.limited.fetch_add(1, Ordering::Relaxed);
            }
            if shadow_limited {
                c.shadow_limited.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Records a request that `tier` would have checked on `endpoint`,
    /// passed unchecked because the backend failed (fail open).
    pub(crate) fn record_fail_open(&self, endpoint: &Endpoint, tier: usize, now_s: u64) {
        self.roll(now_s);
        if let Some(c) = endpoint.counts.mine(tier) {
            c.fail_open.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn sketch(&self, tier: usize, kind: Kind, key: &str, count: u64, now_s: u64) {
        if let Some(s) = self.sketches.get(tier) {
            s.record(kind, key, count, now_s);
        }
    }

    /// Closes the bucket when `now_s` (Unix epoch seconds) is past it: feeds
    /// every series' baseline and the history. Lazy, by whichever request
    /// notices first; [`record`](Self::record) does it first, and a caller
    /// that records several tiers of one request calls it once, then
    /// [`record_rolled`](Self::record_rolled) per tier.
    pub(crate) fn roll(&self, now_s: u64) {
        let bucket = now_s / self.config.bucket_secs.max(1);
        let current = self.bucket.load(Ordering::Acquire);
        if bucket <= current {
            return;
        }
        let Ok(_guard) = self.roll.try_lock() else {
            return;
        };
        if self.bucket.load(Ordering::Acquire) != current {
            return;
        }
        self.bucket.store(bucket, Ordering::Release);
        if current == 0 {
            return; // the first request: nothing to close yet
        }
        let start = current * self.config.bucket_secs.max(1);
        let map = self.series.load();
        let mut totals = vec![
            BucketCounts {
                start,
                ..Default::default()
            };
            self.tiers.len()
        ];
        for (endpoint, e) in map.iter() {
            for (t, s) in e.series.iter().enumerate() {
                let [requests, limited, shadow, fail_open] =
                    e.counts.sum(t, |c| c.swap(0, Ordering::Relaxed));
                if let Some(tot) = totals.get_mut(t) {
                    tot.requests += requests;
                    tot.limited += limited;
                    tot.shadow_limited += shadow;
                    tot.fail_open += fail_open;
                }
                let mut b = s.baseline.lock().unwrap_or_else(|e| e.into_inner());
                // Shadow rejections count: they are what enforcement would do.
                let tier = &*self.tiers[t];
                match b.observe(&self.config, requests, limited + shadow) {
                    Some(Transition::Raised) => {
                        tracing::warn!(
                            tier,
                            endpoint = &**endpoint,
                            rate = b.last_rate,
                            mean = b.mean,
                            sigma = b.var.sqrt(),
                            "429 rate anomaly: outside the baseline"
                        );
                        metrics::gauge!(super::ANOMALY, "tier" => tier.to_owned(), "endpoint" => endpoint.to_string())
                            .set(1.0);
                    }
                    Some(Transition::Cleared) => {
                        tracing::info!(
                            tier,
                            endpoint = &**endpoint,
                            rate = b.last_rate,
                            "429 rate back to its baseline"
                        );
                        metrics::gauge!(super::ANOMALY, "tier" => tier.to_owned(), "endpoint" => endpoint.to_string())
                            .set(0.0);
                    }
                    None => {}
                }
            }
        }
        drop(map);
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        for (h, tot) in history.iter_mut().zip(totals) {
            h.push_back(tot);
            while h.len() > HISTORY_BUCKETS {
                h.pop_front();
            }
        }
    }

    pub(crate) fn anomalies(&self) -> Vec<AnomalyStatus> {
        let map = self.series.load();
        let mut out = Vec::new();
        for (endpoint, e) in map.iter() {
            for (t, s) in e.series.iter().enumerate() {
                let b = s.baseline.lock().unwrap_or_else(|e| e.into_inner());
                if b.buckets == 0 {
                    continue;
                }
                out.push(AnomalyStatus {
                    tier: self.tiers[t].to_string(),
                    endpoint: endpoint.to_string(),
                    alerting: b.alerting,
                    rate: b.last_rate,
                    mean: b.mean,
                    sigma: b.var.sqrt(),
                });
            }
        }
        out.sort_by(|a, b| (&a.tier, &a.endpoint).cmp(&(&b.tier, &b.endpoint)));
        out
    }

    /// The tier's counts so far in the bucket not yet closed (the current
    /// one, or the last one with traffic until a request closes it), or
    /// `None` before the first request.
    pub(crate) fn open_bucket(&self, tier: usize) -> Option<BucketCounts> {
        let bucket = self.bucket.load(Ordering::Acquire);
        if bucket == 0 || tier >= self.tiers.len() {
            return None;
        }
        let mut b = BucketCounts {
            start: bucket * self.config.bucket_secs.max(1),
            ..Default::default()
        };
        for e in self.series.load().values() {
            if tier < e.series.len() {
                let [requests, limited, shadow, fail_open] =
                    e.counts.sum(tier, |c| c.load(Ordering::Relaxed));
                b.requests += requests;
                b.limited += limited;
                b.shadow_limited += shadow;
                b.fail_open += fail_open;
            }
        }
        Some(b)
    }

    pub(crate) fn history(&self, tier: usize) -> Vec<BucketCounts> {
        let h = self.history.lock().unwrap_or_else(|e| e.into_inner());
        h.get(tier)
            .map(|d| d.iter().copied().collect())
            .unwrap_or_default()
    }

    pub(crate) fn top(
        &self,
        tier: usize,
        kind: Kind,
        n: usize,
        hours: u64,
        now_s: u64,
    ) -> Vec<BlockedKey> {
        self.sketches
            .get(tier)
            .map(|s| s.top(kind, n, hours, now_s))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observer(max_endpoints: usize) -> Observer {
        Observer::new(
            vec![Arc::from("ip")],
            AnomalyConfig::default(),
            16,
            max_endpoints,
        )
    }

    /// The thread's last lookup answers a repeat only for the same
    /// observer, method and route: each label keeps its own series, and
    /// each observer its own.
    #[test]
    fn a_repeated_endpoint_is_the_same_series_and_only_its_own() {
        let a = observer(8);
        let b = observer(8);
        let get = a.endpoint("GET", "/users/{id}");
        assert_eq!(&*get.name, "GET /users/{id}");
        assert!(Arc::ptr_eq(&get, &a.endpoint("GET", "/users/{id}")));
        let post = a.endpoint("POST", "/users/{id}");
        assert_eq!(&*post.name, "POST /users/{id}");
        assert!(!Arc::ptr_eq(&get, &post));
        let other_route = a.endpoint("GET", "/users");
        assert_eq!(&*other_route.name, "GET /users");
        // Another observer's series, though this thread just looked the
        // same label up in `a`.
        let in_b = b.endpoint("GET", "/users");
        assert!(!Arc::ptr_eq(&other_route, &in_b));
        assert_eq!((in_b.id, &*in_b.name), (0, "GET /users"));
        assert!(Arc::ptr_eq(&get, &a.endpoint("GET", "/users/{id}")));
        assert_eq!(a.series.load().len(), 3);
    }

    /// Past the cap a new label shares `<other>`, and still does when it
    /// repeats (answered from the thread's last lookup).
    #[test]
    fn a_label_past_the_cap_stays_other_when_repeated() {
        let o = observer(1);
        let first = o.endpoint("GET", "/a");
        assert_eq!(&*first.name, "GET /a");
        for _ in 0..2 {
            assert_eq!(&*o.endpoint("GET", "/b").name, OTHER_ENDPOINT);
        }
        assert!(Arc::ptr_eq(&first, &o.endpoint("GET", "/a")));
        assert_eq!(&*o.endpoint("GET", "/b").name, OTHER_ENDPOINT);
    }
}
