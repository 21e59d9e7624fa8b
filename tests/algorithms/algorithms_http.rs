//! Each algorithm through a real axum server over TCP, on both backends,
//! with exact header values: a burst, refill, the boundary case, weighted
//! cost. Time is a `ManualClock` at T0 (a multiple of 10 s). The scenarios
//! live in tests/support/algorithms_http.rs (tests/redis/cluster.rs runs them on a
//! Redis Cluster too).

use crate::support::{algorithms_http as scenario, Env};

both_backends!(
    fixed_window,
    sliding_window_log,
    sliding_window_counter,
    leaky_bucket_police,
    leaky_bucket_shape_delays_then_rejects,
    weighted_and_oversized_costs,
    calendar_day,
);

async fn calendar_day(env: Env) {
    scenario::calendar_day(env.builder(), &env.clock).await;
}

async fn fixed_window(env: Env) {
    scenario::fixed_window(env.builder(), &env.clock).await;
}

async fn sliding_window_log(env: Env) {
    scenario::sliding_window_log(env.builder(), &env.clock).await;
}

async fn sliding_window_counter(env: Env) {
    scenario::sliding_window_counter(env.builder(), &env.clock).await;
}

async fn leaky_bucket_police(env: Env) {
    scenario::leaky_bucket_police(env.builder(), &env.clock).await;
}

async fn leaky_bucket_shape_delays_then_rejects(env: Env) {
    scenario::leaky_bucket_shape_delays_then_rejects(env.builder()).await;
}

async fn weighted_and_oversized_costs(env: Env) {
    scenario::weighted_and_oversized_costs(env.builder()).await;
}
