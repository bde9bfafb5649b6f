//! The relay's upkeep beside its sessions: the slot's lag, the periodic
//! check of the publication and the mapped tables, and dropping a slot
//! that cannot go on.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use super::publication::{self, Mode};
use super::relay::Inner;
use super::slot;
use super::state;
use super::stream::SQL_TIMEOUT;

/// Drops the slot (if it is still there), for the next session to create
/// it anew with a resync; retried while a failed session's walsender still
/// holds it. `false`: it could not be dropped within the SQL timeout.
pub(super) async fn drop_slot(inner: &Inner) -> bool {
    let params = [inner.shared.slot.as_str()];
    let dropped = slot::until_done(
        &inner.pool,
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
        &params,
    );
    tokio::time::timeout(SQL_TIMEOUT, dropped).await.is_ok()
}

pub(super) async fn lag_loop(
    inner: Arc<Inner>,
    mut stop: watch::Receiver<bool>,
    every: Duration,
    warn_over: u64,
) {
    let mut warned = false;
    loop {
        match tokio::time::timeout(SQL_TIMEOUT, slot::lag(&inner.pool, &inner.shared.slot)).await {
            Ok(Ok(Some(lag))) => {
                let bytes = lag.bytes;
                inner.shared.lag_bytes.store(bytes, Ordering::Relaxed);
                // The server's clock, like the commit times it is
                // compared with: the lag in seconds grows while the relay
                // is stuck, whatever the stream says.
                inner
                    .shared
                    .server_time
                    .fetch_max(lag.server_now_us, Ordering::Relaxed);
                if bytes > warn_over {
                    if !warned {
                        tracing::warn!(slot = %inner.shared.slot, lag_bytes = bytes, safe_wal_size = ?lag.safe_wal_size, "cdc relay: the slot is far behind and pins the server's WAL");
                    }
                    warned = true;
                } else {
                    warned = false;
                }
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "cdc relay: reading the slot's lag failed"),
            Err(_) => tracing::debug!("cdc relay: reading the slot's lag timed out"),
        }
        check_publication(&inner).await;
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The periodic check of the publication and the mapped tables (see
/// `publication`): what an operator changed is put back, with the resync
/// it calls for owed; then any resync owed is settled.
pub(super) async fn check_publication(inner: &Inner) {
    let slot = &inner.shared.slot;
    let checked = tokio::time::timeout(SQL_TIMEOUT, async {
        let changed = publication::check(
            &inner.pool,
            &inner.publication,
            slot,
            &inner.relations,
            Mode::Running,
        )
        .await?;
        if !changed.is_empty() {
            tracing::warn!(slot = %slot, publication = %inner.publication, ?changed, "cdc relay: the publication or a mapped table changed under the relay; resyncing what it may have hidden");
        }
        state::settle(&inner.pool, &inner.publication, slot).await
    })
    .await;
    match checked {
        Ok(Ok(_)) => {}
        // An operator action goes unanswered until the check passes: say so.
        Ok(Err(e)) => {
            tracing::warn!(slot = %slot, error = %e, "cdc relay: checking the publication and the mapped tables failed")
        }
        Err(_) => {
            tracing::warn!(slot = %slot, "cdc relay: checking the publication and the mapped tables timed out")
        }
    }
}
