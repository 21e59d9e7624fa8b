//! Reload without a restart: the configuration's files are watched
//! (`notify`), and after a change settles (200 ms without another event)
//! the configuration is read again. A valid one is swapped in atomically
//! (`arc-swap`: a call in flight finishes on the limiters it started with,
//! the next one sees the new ones); an invalid one is logged at `ERROR`
//! with its message and counted, and the old configuration keeps serving.
//! Counted in `tiered_ratelimit_rls_config_loads_total{result="success"|"error"}`
//! (the reference service's `config_load_success` / `config_load_error`).
//!
//! The binary watches the reference's YAML (its runtime root or config
//! directory, recursively, and a swap of that path itself when it is a
//! symlink) and our TOML rules file (its directory, not recursively: an
//! editor's rename-over and a Kubernetes ConfigMap's `..data` symlink swap
//! both happen there).

use arc_swap::ArcSwap;
pub use notify::RecursiveMode;
use notify::Watcher;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tiered_ratelimit::descriptor::DomainLimiters;

/// How long the files must be quiet before a reload: editors and
/// `kubectl` ConfigMap swaps write in several steps.
pub const SETTLE: Duration = Duration::from_millis(200);

/// The metric counting reloads by `result`.
pub const CONFIG_LOADS: &str = "tiered_ratelimit_rls_config_loads_total";

/// A running watch; dropping it stops watching.
#[derive(Debug)]
pub struct Watch {
    _watcher: Arc<std::sync::Mutex<notify::RecommendedWatcher>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Watches `path` (`mode`: recursively or not) and, after each settled
/// change, stores what `load` builds in `target`, or logs and counts its
/// error. `path` itself may be a symlink that is swapped (the reference's
/// `RUNTIME_ROOT` under `RUNTIME_WATCH_ROOT`, a deploy's `current ->
/// releases/N`): its parent directory is watched too, for events naming
/// `path`, and after each settled change the watch on `path` is set again,
/// so it follows the new target. Must be called inside a Tokio runtime
/// (the reload runs there, so the engines it builds start their tasks).
///
/// # Errors
/// The watcher's, when `path` cannot be watched (its parent, which only
/// serves a symlink swap, is logged at `WARN` when it cannot be).
pub fn watch<F>(
    path: PathBuf,
    mode: RecursiveMode,
    target: Arc<ArcSwap<DomainLimiters>>,
    load: F,
) -> Result<Watch, notify::Error>
where
    F: Fn() -> Result<DomainLimiters, String> + Send + 'static,
{
    // Absolute without resolving symlinks: the events name it as given.
    let path = std::path::absolute(&path).unwrap_or(path);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let watched = path.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let relevant = event
            .is_ok_and(|e| !e.kind.is_access() && e.paths.iter().any(|p| p.starts_with(&watched)));
        if relevant {
            // Full: a reload is already due.
            let _ = tx.try_send(());
        }
    })?;
    watcher.watch(&path, mode)?;
    if let Some(parent) = path.parent() {
        if let Err(e) = watcher.watch(parent, RecursiveMode::NonRecursive) {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "cannot watch its parent directory: a swap of the path itself (a symlink) is not seen"
            );
        }
    }
    let watcher = Arc::new(std::sync::Mutex::new(watcher));
    metrics::describe_counter!(
        CONFIG_LOADS,
        "Configuration reloads after a change of its files, by result (success, error)"
    );
    let rearm = watcher.clone();
    let task = tokio::spawn(async move {
        while rx.recv().await.is_some() {
            // Settle: wait until SETTLE passes without another event.
            loop {
                match tokio::time::timeout(SETTLE, rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            // A swapped symlink: the old watch is on the old target.
            if let Ok(mut w) = rearm.lock() {
                let _ = w.unwatch(&path);
                if let Err(e) = w.watch(&path, mode) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot watch again");
                }
            }
            match load() {
                Ok(limiters) => {
                    let domains = limiters.domains().join(",");
                    target.store(Arc::new(limiters));
                    metrics::counter!(CONFIG_LOADS, "result" => "success").increment(1);
                    tracing::info!(%domains, "configuration reloaded");
                }
                Err(e) => {
                    metrics::counter!(CONFIG_LOADS, "result" => "error").increment(1);
                    tracing::error!(
                        error = %e,
                        "configuration change refused; the previous configuration keeps serving"
                    );
                }
            }
        }
    });
    Ok(Watch {
        _watcher: watcher,
        task,
    })
}
