//! Route templates (`--route '/users/{id}'`): which one a logged path
//! matches, as axum's `Router` would decide it, and the genuine
//! `MatchedPath` the `endpoint` tier reads.
//!
//! Matching uses `matchit`, the router inside axum, at the version axum
//! pins, so a path matches exactly the route axum would pick. The first
//! time a route is hit, the path is also sent through a real axum `Router`:
//! that yields the `MatchedPath` value (it cannot be built outside axum) and
//! checks that both routers agree.

use axum::extract::MatchedPath;
use axum::response::IntoResponse;
use axum::routing::any;
use std::future::Future;
use std::task::{Context, Poll, Waker};
use tower::Service;

pub(crate) struct Routes {
    patterns: Vec<String>,
    matcher: matchit::Router<usize>,
    /// A router that answers each route with its `MatchedPath`.
    capture: axum::Router,
    matched: Vec<Option<MatchedPath>>,
}

/// axum's own checks on a route (its `Router::route` panics on them).
fn validate(pattern: &str) -> Result<(), String> {
    if !pattern.starts_with('/') {
        return Err("routes must start with `/`".into());
    }
    for segment in pattern.split('/') {
        if segment.starts_with(':') {
            return Err("segments must not start with `:`; captures are written `{name}`".into());
        }
        if segment.starts_with('*') {
            return Err("segments must not start with `*`; wildcards are written `{*name}`".into());
        }
    }
    Ok(())
}

async fn capture(path: MatchedPath) -> axum::response::Response {
    let mut res = ().into_response();
    res.extensions_mut().insert(path);
    res
}

impl Routes {
    pub(crate) fn new(patterns: &[String]) -> Result<Self, (String, String)> {
        let mut matcher = matchit::Router::new();
        let mut capture_router = axum::Router::new();
        let mut uniq: Vec<String> = Vec::new();
        for p in patterns {
            if uniq.contains(p) {
                continue;
            }
            validate(p).map_err(|e| (p.clone(), e))?;
            matcher
                .insert(p.clone(), uniq.len())
                .map_err(|e| (p.clone(), e.to_string()))?;
            let r = std::mem::take(&mut capture_router);
            capture_router =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.route(p, any(capture))))
                    .map_err(|_| (p.clone(), "axum rejects this route".to_owned()))?;
            uniq.push(p.clone());
        }
        let n = uniq.len();
        Ok(Self {
            patterns: uniq,
            matcher,
            capture: capture_router,
            matched: vec![None; n],
        })
    }

    pub(crate) fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// The route `path` (a URI's path) matches, if any.
    pub(crate) fn find(&self, path: &str) -> Option<usize> {
        self.matcher.at(path).ok().map(|m| *m.value)
    }

    /// The `MatchedPath` of route `idx`, which `uri` matched.
    ///
    /// # Errors
    /// When axum's router does not route `uri` to that route (a version
    /// mismatch between axum and the matcher).
    pub(crate) fn matched_path(
        &mut self,
        idx: usize,
        uri: &http::Uri,
    ) -> Result<MatchedPath, String> {
        if let Some(m) = &self.matched[idx] {
            return Ok(m.clone());
        }
        let req = http::Request::builder()
            .uri(uri.clone())
            .body(axum::body::Body::empty())
            .map_err(|e| e.to_string())?;
        let mut fut = std::pin::pin!(self.capture.call(req));
        let got = match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(res)) => res.extensions().get::<MatchedPath>().cloned(),
            _ => None,
        };
        match got {
            Some(m) if m.as_str() == self.patterns[idx] => {
                self.matched[idx] = Some(m.clone());
                Ok(m)
            }
            other => Err(format!(
                "path {:?}: matchit picked route {:?} but axum picked {:?}",
                uri.path(),
                self.patterns[idx],
                other.as_ref().map(MatchedPath::as_str)
            )),
        }
    }
}
