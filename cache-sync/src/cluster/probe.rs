//! Key probes: which node holds which version of one key, right now.
//!
//! Gathered like an acknowledged publish (`ack.rs`): one request on the
//! heartbeat channel, signed like everything on it, and one answer from
//! each node that holds the cache, which only this party reads. A node
//! answers at once, with what its cache holds for the key under the key's
//! write lock, so a node held back by its transport shows the version it
//! is at, not the one the others reached.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ack::Incomplete;
use super::message::Probe;
use super::requests::{FirstSend, Requests, Wait};
use super::{Ack, Cluster, Message};
use crate::error::{Error, Result};
use crate::status::KeyState;

/// What every live node that holds a cache holds for one key, as
/// [`Cluster::probe`] found it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct KeyProbe {
    /// The cache.
    pub cache: String,
    /// The key, as JSON.
    pub key: String,
    /// Every live node that holds the cache, by id, with what it answered
    /// (`None`: no answer before the wait ended).
    pub nodes: Vec<NodeKey>,
    /// From the start of the probe until every node answered, or the
    /// timeout.
    #[serde(with = "super::ack::micros")]
    pub elapsed: Duration,
    /// Why the probe may be missing a node, if it may: see [`Incomplete`]
    /// (`Pending`: a node did not answer).
    pub incomplete: Option<Incomplete>,
}

/// One node in a [`KeyProbe`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeKey {
    /// The node's id.
    pub node_id: String,
    /// What it holds for the key; `None` if it did not answer in time.
    pub state: Option<KeyState>,
}

impl KeyProbe {
    /// Whether every live node that holds the cache answered, as a view
    /// that could be trusted to know every live node tells.
    pub fn is_complete(&self) -> bool {
        self.incomplete.is_none()
    }

    /// The newest version any node that answered knows for the key.
    pub fn newest(&self) -> Option<u64> {
        self.answered().filter_map(|(_, s)| s.version).max()
    }

    /// Whether every node that answered knows the same version of the key
    /// (or none) and holds it alike; a node that did not answer is not
    /// counted (see [`incomplete`](Self::incomplete)). Never while a node
    /// could not read the key (see [`refused`](Self::refused)): nodes that
    /// all refused it said nothing about it, least of all that they agree.
    pub fn agrees(&self) -> bool {
        if self.refused().next().is_some() {
            return false;
        }
        let mut states = self.answered().map(|(_, s)| (s.version, s.held));
        match states.next() {
            None => true,
            Some(first) => states.all(|s| s == first),
        }
    }

    /// The nodes that answered that they could not read the key as their
    /// cache's key type (their answer's `error`): the key was of another
    /// type, or those nodes hold another cache under the name.
    pub fn refused(&self) -> impl Iterator<Item = &str> {
        self.answered()
            .filter(|(_, s)| s.error.is_some())
            .map(|(id, _)| id)
    }

    /// The nodes whose answer differs from the newest: an older version,
    /// or none while another node knows one, or the newest not held while
    /// another node holds it.
    pub fn behind(&self) -> impl Iterator<Item = &str> {
        let newest = self.newest();
        let held_newest = self.answered().any(|(_, s)| s.held && s.version == newest);
        self.answered()
            .filter(move |(_, s)| s.version < newest || (held_newest && !s.held))
            .map(|(id, _)| id)
    }

    fn answered(&self) -> impl Iterator<Item = (&str, &KeyState)> {
        self.nodes
            .iter()
            .filter_map(|n| n.state.as_ref().map(|s| (n.node_id.as_str(), s)))
    }
}

/// One line per node (`n1: holds, version 9`, `n3: holds, version 5  <-
/// differs`, `n4: no answer`, `n5: error: …`), then one that sums up: `all
/// 3 nodes agree`, `the nodes disagree`, `2 of 3 nodes could not read the
/// key`, or `incomplete: …` (`some nodes did not answer`, and the other
/// reasons of [`Incomplete`]) with the refusals after it, if any.
impl fmt::Display for KeyProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A set: one look-up per node, not a scan of the others.
        let behind: std::collections::HashSet<&str> = self.behind().collect();
        for n in &self.nodes {
            write!(f, "{}: ", n.node_id)?;
            match &n.state {
                None => write!(f, "no answer")?,
                Some(s) => {
                    if let Some(e) = &s.error {
                        write!(f, "error: {e}")?;
                    } else {
                        f.write_str(if s.held { "holds" } else { "absent" })?;
                        match s.version {
                            Some(v) => write!(f, ", version {v}")?,
                            None => write!(f, ", no version")?,
                        }
                        if s.quarantined {
                            write!(f, ", quarantined")?;
                        }
                    }
                    if behind.contains(n.node_id.as_str()) {
                        write!(f, "  <- differs")?;
                    }
                }
            }
            writeln!(f)?;
        }
        let refused = self.refused().count();
        let refusals = |f: &mut fmt::Formatter<'_>| {
            write!(
                f,
                "{refused} of {} nodes could not read the key",
                self.nodes.len()
            )
        };
        match self.incomplete {
            // The probe's own words: `Incomplete`'s say what an
            // acknowledgement waits for ("had not applied it").
            Some(Incomplete::Pending) => write!(f, "incomplete: some nodes did not answer")?,
            Some(why) => write!(f, "incomplete: {why}")?,
            None if refused > 0 => return refusals(f),
            None if self.agrees() => {
                return write!(f, "all {} nodes agree", self.nodes.len());
            }
            None => return write!(f, "the nodes disagree"),
        }
        if refused > 0 {
            write!(f, "; ")?;
            refusals(f)?;
        }
        Ok(())
    }
}

/// The longest key a probe carries, as JSON.
pub(crate) const MAX_PROBE_KEY_BYTES: usize = 4096;

/// The probes a party waits on, and the answers in, by probe id (see
/// `requests.rs`). An entry lives while its probe does.
#[derive(Default)]
pub(crate) struct Probes {
    waiting: Requests<KeyState>,
}

impl Probes {
    /// Takes an answer in; whether it answered a probe still waited on.
    pub(crate) fn answered(&self, ack: &Ack) -> bool {
        if ack.probed.is_empty() {
            return false;
        }
        let answers = ack.probed.iter().map(|p| (p.id, &p.state));
        self.waiting
            .answered(&ack.node_id, answers, KeyState::clone)
    }
}

impl Cluster {
    /// Asks every live node that holds `cache` what it holds for `key`
    /// now: whether it holds a value, the newest version it knows, whether
    /// the cache is quarantined, and the key's trace there if the cache
    /// traces. Waits until every such node answered, or `timeout`.
    ///
    /// The key travels as JSON on the heartbeat channel (signed when the
    /// party has a keyring), and each node reads it as its cache's key
    /// type; a node for which it is no such key answers with an `error`.
    /// At most 4 KiB of JSON, or this fails with [`Error::Config`]. As
    /// for [`Acks`](super::Acks), a view that may not know every live node
    /// yet says so in `incomplete`.
    pub async fn probe(
        &self,
        cache: &str,
        key: &(impl Serialize + ?Sized),
        timeout: Duration,
    ) -> Result<KeyProbe> {
        let key =
            serde_json::to_string(key).map_err(|e| Error::Config(format!("probe key: {e}")))?;
        if key.len() > MAX_PROBE_KEY_BYTES {
            return Err(Error::Config(format!(
                "probe key: {} bytes of JSON, over {MAX_PROBE_KEY_BYTES}",
                key.len()
            )));
        }
        let wait = Wait::start(self, timeout);
        let probes = &self.inner.probes;
        let registered = probes.waiting.register();
        let probe = Probe {
            topic: self.topic().to_owned(),
            cache: cache.to_owned(),
            key: key.clone(),
            asker: self.asker(),
            id: registered.id,
            reply: self.reads_replies(),
        };
        // Sent at once and waited for, as no node can answer before it is
        // out; then again, as an acknowledgement request is, while nodes
        // are missing: the channel may lose it, or a node may join
        // meanwhile.
        let first = FirstSend::Awaited;
        let gathered = wait
            .gather(self, cache, Message::Probe(probe), first, || {
                probes.waiting.answers(registered.id)
            })
            .await;
        Ok(KeyProbe {
            cache: cache.to_owned(),
            key,
            nodes: gathered
                .nodes
                .into_iter()
                .map(|(node_id, state)| NodeKey { state, node_id })
                .collect(),
            elapsed: gathered.elapsed,
            incomplete: gathered.incomplete,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, state: Option<(bool, Option<u64>, Option<&str>)>) -> NodeKey {
        NodeKey {
            node_id: id.to_owned(),
            state: state.map(|(held, version, error)| KeyState {
                held,
                version,
                quarantined: false,
                trace: Vec::new(),
                error: error.map(str::to_owned),
            }),
        }
    }

    fn probe(nodes: Vec<NodeKey>, incomplete: Option<Incomplete>) -> KeyProbe {
        KeyProbe {
            cache: "ids".into(),
            key: "\"abc\"".into(),
            nodes,
            elapsed: Duration::ZERO,
            incomplete,
        }
    }

    /// Issue 35, item 9: a probe says what a probe found, in its own
    /// words. A node that did not answer is not one that "had not applied
    /// it" (an acknowledgement's words); a node that could not read the key
    /// never agrees, even with others that could not either.
    #[test]
    fn a_probe_reports_refusals_and_missing_answers_in_its_own_words() {
        let refused = Some((false, None, Some("the key is not one of this cache's")));
        let all_refused = probe(vec![node("n1", refused), node("n2", refused)], None);
        assert!(!all_refused.agrees());
        assert_eq!(all_refused.refused().collect::<Vec<_>>(), ["n1", "n2"]);
        let text = all_refused.to_string();
        assert!(
            text.ends_with("\n2 of 2 nodes could not read the key"),
            "{text}"
        );
        assert!(!text.contains("agree"), "{text}");

        let held = Some((true, Some(3), None));
        let one_refused = probe(vec![node("n1", held), node("n2", refused)], None);
        assert!(!one_refused.agrees());
        assert!(
            one_refused
                .to_string()
                .ends_with("1 of 2 nodes could not read the key")
        );

        let pending = probe(
            vec![node("n1", held), node("n2", None)],
            Some(Incomplete::Pending),
        );
        let text = pending.to_string();
        assert!(text.contains("n2: no answer"), "{text}");
        assert!(
            text.ends_with("incomplete: some nodes did not answer"),
            "{text}"
        );
        assert!(!text.contains("applied"), "{text}");
        let both = probe(
            vec![node("n1", refused), node("n2", None)],
            Some(Incomplete::Pending),
        );
        assert!(
            both.to_string().ends_with(
                "incomplete: some nodes did not answer; 1 of 2 nodes could not read the key"
            ),
            "{both}"
        );

        let agreeing = probe(vec![node("n1", held), node("n2", held)], None);
        assert!(agreeing.agrees() && agreeing.refused().next().is_none());
        assert!(agreeing.to_string().ends_with("all 2 nodes agree"));
    }
}
