//! A watcher's task: reads the heartbeat channel for a [`Cluster`] that
//! is not a node's (a node's heartbeat task reads it for its own view), and
//! subscribes again after errors.

use tokio::sync::watch;

use super::channel::{CHANNEL_BACKOFF_MAX, CHANNEL_BACKOFF_MIN};
use super::handle::Inner;
use super::{Cluster, Message, Request};
use crate::util::Backoff;

/// A watcher's task: takes heartbeats in, and subscribes again after errors.
pub(super) async fn watch_loop(
    cluster: std::sync::Weak<Inner>,
    subscription: Box<dyn crate::transport::HeartbeatSubscription>,
    mut stop: watch::Receiver<bool>,
) {
    let mut sub = Some(subscription);
    let mut backoff = Backoff::new(CHANNEL_BACKOFF_MIN, CHANNEL_BACKOFF_MAX);
    loop {
        let Some(inner) = cluster.upgrade() else {
            return;
        };
        let view = Cluster { inner };
        let Some(s) = sub.as_mut() else {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(backoff.wait()) => {}
            }
            // A broker that is down can take its timeout to answer: the
            // stop must not wait for that.
            let subscribed = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                subscribed = view.inner.transport.subscribe_heartbeats(&view.inner.topic) => subscribed,
            };
            match subscribed {
                Ok(s) => {
                    sub = Some(s);
                    backoff.reset();
                    let roll_call = Message::Request(Request::roll_call(&view.inner.topic));
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => return,
                        sent = view.send(&roll_call) => view.listening(sent),
                    }
                }
                Err(e) => {
                    backoff.fail();
                    tracing::warn!(observer = %view.inner.observer, error = %e, retry_in = ?backoff.wait(),
                        "heartbeat channel: subscribe failed");
                }
            }
            continue;
        };
        // The view is not held while waiting, so dropping the last clone
        // stops the task.
        drop(view);
        let next = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            next = s.next() => next,
        };
        let Some(inner) = cluster.upgrade() else {
            return;
        };
        let view = Cluster { inner };
        match next {
            Ok(payload) => {
                let _ = view.receive(&payload);
            }
            Err(e) => {
                view.deaf();
                backoff.fail();
                tracing::warn!(observer = %view.inner.observer, error = %e, retry_in = ?backoff.wait(),
                    "heartbeat channel: subscription failed; subscribing again");
                sub = None;
            }
        }
    }
}
