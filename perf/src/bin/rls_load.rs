//! The load generator of `perf/rls.sh`: `ShouldRateLimit` calls against a
//! `tiered-ratelimit-rls` server from `concurrency` tasks over one HTTP/2
//! connection each, for `seconds`, each call carrying 1 or 4 descriptors
//! (perf/README.md).
//!
//! ```text
//! rls_load <addr> <descriptors: 1|4> [concurrency=32] [seconds=5]
//! ```
//!
//! Prints one line: `calls=N seconds=S rps=R over_limit=O errors=E
//! p50_us=P p99_us=Q`. Keys vary per call (1000 addresses, 100 users), so
//! the server holds a realistic handful of keys.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use std::time::{Duration, Instant};

fn descriptor(entries: &[(&str, String)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).to_owned(),
                value: v.clone(),
            })
            .collect(),
        ..Default::default()
    }
}

/// Call `i` of task `t`: 1 descriptor (the address) or 4 (address, user and
/// path, tenant, the global key).
fn request(t: usize, i: usize, n: usize) -> RateLimitRequest {
    let k = t * 7919 + i;
    let mut descriptors = vec![descriptor(&[(
        "remote_address",
        format!("10.0.{}.{}", (k / 250) % 4, k % 250),
    )])];
    if n >= 4 {
        descriptors.push(descriptor(&[
            ("user", format!("user{}", k % 100)),
            ("path", "/api/items".to_owned()),
        ]));
        descriptors.push(descriptor(&[("tenant", format!("t{}", k % 10))]));
        descriptors.push(descriptor(&[("generic_key", "global".to_owned())]));
    }
    RateLimitRequest {
        domain: "bench".into(),
        descriptors,
        hits_addend: 1,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "rls_load <addr> <descriptors: 1|4> [concurrency=32] [seconds=5]";
    let addr = args.get(1).ok_or(usage)?.clone();
    let n: usize = args.get(2).ok_or(usage)?.parse()?;
    let concurrency: usize = args.get(3).map_or(Ok(32), |s| s.parse())?;
    let seconds: u64 = args.get(4).map_or(Ok(5), |s| s.parse())?;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        tasks.push(tokio::spawn(async move {
            let mut c = RateLimitServiceClient::new(channel);
            let (mut over, mut errors) = (0u64, 0u64);
            let mut lat = Vec::with_capacity(100_000);
            let mut i = 0;
            while Instant::now() < deadline {
                let t0 = Instant::now();
                match c.should_rate_limit(request(t, i, n)).await {
                    Ok(r) if r.get_ref().overall_code == Code::OverLimit as i32 => over += 1,
                    Ok(_) => {}
                    Err(_) => errors += 1,
                }
                lat.push(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
                i += 1;
            }
            (lat, over, errors)
        }));
    }
    let (mut lat, mut over, mut errors) = (Vec::new(), 0, 0);
    for t in tasks {
        let (l, o, e) = t.await?;
        lat.extend(l);
        over += o;
        errors += e;
    }
    let secs = started.elapsed().as_secs_f64();
    lat.sort_unstable();
    let q = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "calls={} seconds={secs:.3} rps={:.0} over_limit={over} errors={errors} p50_us={} p99_us={}",
        lat.len(),
        lat.len() as f64 / secs,
        q(0.50),
        q(0.99)
    );
    Ok(())
}
