//! The topic's stream (made on first use and remembered, refused if it
//! belongs to something else) and publishing into it. `subscribe` opens the
//! stream through here too, so both agree on its configuration.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;

use super::super::{Position, Transport};
use super::NatsJetStreamTransport;
use super::naming::{MARKER, TAG_HEADER, created, header_char, seq_position};
use crate::error::{Error, Result};
use crate::transport::names;
use crate::util::lock;

impl NatsJetStreamTransport {
    /// Makes sure the topic's stream exists, asking the server only the
    /// first time (or after `forget_stream`).
    pub(super) async fn ensure_stream(&self, topic: &str) -> Result<u64> {
        if let Some(created) = lock(&self.known_streams).get(topic) {
            return Ok(*created);
        }
        let created = created(self.stream(topic).await?.cached_info());
        lock(&self.known_streams).insert(topic.to_owned(), created);
        Ok(created)
    }

    pub(super) fn forget_stream(&self, topic: &str) {
        lock(&self.known_streams).remove(topic);
    }

    pub(super) async fn publish_once(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
        created: u64,
    ) -> std::result::Result<Option<Position>, jetstream::context::PublishError> {
        let mut headers = HeaderMap::new();
        // Escaped: header values lose leading and trailing spaces, and
        // cannot hold line breaks.
        headers.insert(
            TAG_HEADER,
            names::escape_with(tag, MARKER, header_char).as_ref(),
        );
        let ack = self
            .js
            .publish_with_headers(self.subject(topic), headers, payload)
            .await?
            .await?;
        Ok(Some(seq_position(ack.sequence, created)))
    }

    /// The topic's stream, made if missing. A stream of that name that
    /// carries other subjects (another application's, or an older
    /// cache-sync's) is refused rather than read or written.
    pub(super) async fn stream(&self, topic: &str) -> Result<stream::Stream> {
        self.check_topic(topic)?;
        let subject = self.subject(topic);
        let stream = self
            .js
            .get_or_create_stream(stream::Config {
                name: self.stream_name(topic),
                subjects: vec![subject.clone()],
                max_messages: self.config.max_messages,
                retention: stream::RetentionPolicy::Limits,
                discard: stream::DiscardPolicy::Old,
                storage: self.config.storage,
                num_replicas: self.config.replicas,
                ..Default::default()
            })
            .await
            .map_err(|e| self.err(e))?;
        let subjects = &stream.cached_info().config.subjects;
        if subjects != std::slice::from_ref(&subject) {
            return Err(Error::Config(format!(
                "NATS stream {:?} exists with subjects {subjects:?}, not [{subject:?}]; \
                 it belongs to something else, so topic {topic:?} cannot use it",
                self.stream_name(topic)
            )));
        }
        Ok(stream)
    }
}
