//! Heartbeats and replies: core NATS messages on subjects no stream takes,
//! kept nowhere. Apart from the change path, which is JetStream's.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;

use super::super::HeartbeatSubscription;
use super::{KIND, NatsJetStreamTransport};
use crate::error::{Error, Result};

/// How long a heartbeat publish waits for the client to write it out. Core
/// NATS has no acknowledgement; while the client is disconnected a flush
/// waits for the reconnect, so it is bounded like a JetStream request (the
/// client's default request timeout).
const HEARTBEAT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

impl NatsJetStreamTransport {
    /// `<subject>.hb`, the topic's heartbeat subject: one token longer than
    /// any topic's subject, so no stream (each takes exactly its topic's
    /// subject) stores it.
    pub(super) fn heartbeat_subject(&self, topic: &str) -> String {
        format!("{}.hb", self.subject(topic))
    }

    /// `<subject>.hb.r.<to, 16 hex digits>`, a party's reply subject:
    /// longer still, so no stream stores it, and no subscription to the
    /// heartbeat subject (which has no wildcard) takes it.
    pub(super) fn reply_subject(&self, topic: &str, to: u64) -> String {
        format!("{}.r.{to:016x}", self.heartbeat_subject(topic))
    }

    /// Publishes on a core subject (a heartbeat or reply subject).
    pub(super) async fn publish_beat(&self, subject: String, payload: Bytes) -> Result<()> {
        let sent = async {
            self.client
                .publish(subject, payload)
                .await
                .map_err(|e| self.err(e))?;
            // `publish` only queues the message; the flush shows a failure
            // to write it (or, bounded, a client that is not connected).
            self.client.flush().await.map_err(|e| self.err(e))
        };
        tokio::time::timeout(HEARTBEAT_FLUSH_TIMEOUT, sent)
            .await
            .map_err(|e| self.err(e))?
    }

    /// Subscribes to a core subject (a heartbeat or reply subject).
    pub(super) async fn subscribe_beats(
        &self,
        subject: String,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        let subscriber = self
            .client
            .subscribe(subject)
            .await
            .map_err(|e| self.err(e))?;
        // One round trip on the same connection: the server handles a
        // connection's messages in order, so once it answers, the SUB is
        // in place and a message published from now on reaches it. A
        // request to a fresh inbox nobody listens on is answered at once
        // by the server itself, with "no responders".
        match self
            .client
            .request(self.client.new_inbox(), Bytes::new())
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {}
            Err(e) => return Err(self.err(e)),
        }
        Ok(Box::new(NatsHeartbeats(subscriber)))
    }
}

/// A core NATS subscription to a heartbeat subject.
#[derive(Debug)]
struct NatsHeartbeats(async_nats::Subscriber);

#[async_trait]
impl HeartbeatSubscription for NatsHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        match self.0.next().await {
            Some(message) => Ok(message.payload),
            None => Err(Error::disconnected(
                KIND,
                "the heartbeat subscription ended (the client closed)",
            )),
        }
    }
}
