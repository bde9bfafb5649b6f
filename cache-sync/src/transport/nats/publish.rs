//! The topic's stream (made on first use and remembered, refused if it
//! belongs to something else) and publishing into it. `subscribe` opens the
//! stream through here too, so both agree on its configuration.

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;

use super::super::{PendingPublish, Transport};
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

    /// Hands `payload` over to the client, which sends what it is handed in
    /// order on its one connection, and returns the acknowledgement to come,
    /// with the number of this hand-over (`handing`). With `only_after`,
    /// only if that was the number of the last hand-over: `None` if another
    /// came since.
    async fn hand_over(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
        only_after: Option<u64>,
    ) -> std::result::Result<Option<(PublishAckFuture, u64)>, jetstream::context::PublishError>
    {
        let mut headers = HeaderMap::new();
        // Escaped: header values lose leading and trailing spaces, and
        // cannot hold line breaks.
        headers.insert(
            TAG_HEADER,
            names::escape_with(tag, MARKER, header_char).as_ref(),
        );
        // Numbered under the lock that orders hand-overs, so that a number
        // says which hand-overs came after it.
        let mut handed = self.handing.lock().await;
        if only_after.is_some_and(|n| n != *handed) {
            return Ok(None);
        }
        let ack = self
            .js
            .publish_with_headers(self.subject(topic), headers, payload)
            .await?;
        *handed = handed.wrapping_add(1);
        Ok(Some((ack, *handed)))
    }

    /// Publishes in two stages (see [`Transport::start_publish`]): the
    /// record handed to the client, then the stream's acknowledgement.
    ///
    /// A stream deleted behind the transport's back answers "no responders"
    /// (`StreamNotFound`): the message went nowhere. The acknowledgement
    /// then makes the stream again and hands the message over once more,
    /// but only if nothing was handed over since on this transport (it
    /// checks under the lock that orders hand-overs): a retry behind a
    /// later record would put the two out of order on the wire. Otherwise
    /// it fails, its number is missing, and nodes resync the cache (they
    /// see the stream's history reset anyway); the next hand-over makes the
    /// stream again.
    pub(super) async fn start(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> Result<PendingPublish> {
        self.check_tag(tag)?;
        // Creating the stream on first use keeps publishers and nodes free of
        // set-up order.
        let created = self.ensure_stream(topic).await?;
        let (ack, number) = self
            .hand_over(topic, tag, payload.clone(), None)
            .await
            .map_err(|e| self.err(e))?
            .expect("handed over unconditionally");
        let this = self.clone();
        let topic = topic.to_owned();
        let tag = tag.to_owned();
        Ok(PendingPublish::new(async move {
            match ack.await {
                Ok(ack) => Ok(Some(seq_position(ack.sequence, created))),
                Err(e) if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound => {
                    this.forget_stream(&topic);
                    let last = *this.handing.lock().await == number;
                    if !last {
                        return Err(this.err(e));
                    }
                    let created = this.ensure_stream(&topic).await?;
                    // Checked again as it is handed over: someone may have
                    // published while the stream was made.
                    let Some((ack, _)) = this
                        .hand_over(&topic, &tag, payload, Some(number))
                        .await
                        .map_err(|e| this.err(e))?
                    else {
                        return Err(this.err(e));
                    };
                    let ack = ack.await.map_err(|e| this.err(e))?;
                    Ok(Some(seq_position(ack.sequence, created)))
                }
                Err(e) => Err(this.err(e)),
            }
        }))
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
