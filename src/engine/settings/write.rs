//! Writing the fleet-wide settings: a compare-and-set on their version
//! (`lua/settings.lua`), after checking the whole document as `build()`
//! would.

#[cfg(feature = "redis")]
use super::{apply_read, lists_of, parse, runtime_of, stored, SETTINGS, SETTINGS_VERSION};
use super::{Invalid, Settings};
use crate::engine::state::Shared;
use crate::engine::watch::ControlError;

/// How many times a write re-reads and retries when another write came
/// first.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
const WRITE_ATTEMPTS: usize = 8;

/// Writes a change of the fleet-wide settings: reads the stored document,
/// lets `change` edit it, checks the result as `build()` would (nothing is
/// written if it is refused), writes it with the next version if no other
/// write came first (else reads again, up to 8 times), then applies it here
/// at once; the other instances follow within one poll interval. Answers
/// the new version.
pub(crate) async fn write(
    shared: &Shared,
    by: &str,
    change: impl Fn(&mut Settings) -> Result<(), Invalid>,
) -> Result<u64, ControlError> {
    let Some(key) = crate::engine::watch::control_hash_key(shared) else {
        return Err(ControlError::NotConfigured);
    };
    #[cfg(feature = "redis")]
    if let crate::backend::Backend::Redis(redis) = &shared.backend {
        for _ in 0..WRITE_ATTEMPTS {
            let fields = redis.hgetall(key).await?;
            let (version, raw) = stored(&fields).map_err(ControlError::Malformed)?;
            let mut doc = parse(raw).map_err(ControlError::Malformed)?;
            change(&mut doc)?;
            doc.by = Some(by.to_owned());
            let current = shared.live.runtime.load_full();
            runtime_of(shared, &current, &doc)?;
            lists_of(shared, &doc)?;
            let text = if doc.is_empty() {
                String::new()
            } else {
                serde_json::to_string(&doc).map_err(|e| ControlError::Malformed(e.to_string()))?
            };
            match redis.write_settings(key, version, &text).await? {
                Ok(new) => {
                    tracing::info!(target: crate::engine::CONTROL_LOG_TARGET, key, version = new, by,
                        "control key: fleet-wide settings written");
                    let mut fields = vec![(SETTINGS_VERSION.to_owned(), new.to_string())];
                    if !text.is_empty() {
                        fields.push((SETTINGS.to_owned(), text));
                    }
                    apply_read(shared, key, &fields);
                    return Ok(new);
                }
                Err(Some(_)) => continue,
                Err(None) => {
                    return Err(ControlError::Malformed(format!(
                        "{SETTINGS_VERSION} is not a whole number"
                    )))
                }
            }
        }
        return Err(ControlError::Contended);
    }
    let _ = (key, by, change);
    Err(ControlError::NotConfigured)
}
