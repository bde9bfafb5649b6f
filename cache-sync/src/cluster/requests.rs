//! Outstanding requests, acknowledgements' and probes': the requests a
//! party waits on with the answers in from each node (`Requests`), and the
//! wait that sends one, sends it again while answers are missing, and
//! tallies the nodes that hold the cache (`Wait::gather`).

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{Cluster, Incomplete, Message};
use crate::util::{HashMap, deadline_after, lock};

/// Answers kept per request (and per thing a party follows, see `ack.rs`):
/// more live nodes than a view keeps members cannot be waited for anyway.
pub(super) const MAX_ANSWERS: usize = super::members::MAX_MEMBERS;

/// A node id longer than this in an answer is no node a view keeps: the
/// answer is not taken, so a request's answers stay bounded in bytes
/// (`MAX_ANSWERS` ids of at most this), not only in count.
pub(super) const MAX_NODE_ID_BYTES: usize = 4096;

/// How often a wait looks again without a heartbeat to wake it.
const RECHECK: Duration = Duration::from_millis(10);
/// When a wait first sends its request again, if still incomplete.
const RESEND_FIRST: Duration = Duration::from_millis(100);

/// The requests of one kind a party waits on, and the answers in, by
/// request id: each answering node with what is kept of its answer (when
/// it arrived, what it found). An entry lives while its wait does
/// (`Registered` takes it out).
pub(super) struct Requests<V> {
    waiting: Mutex<HashMap<u64, HashMap<String, V>>>,
}

impl<V> Default for Requests<V> {
    fn default() -> Self {
        Requests {
            waiting: Mutex::default(),
        }
    }
}

impl<V: Clone> Requests<V> {
    /// A new request, under a fresh id, with no answer yet.
    pub(super) fn register(&self) -> Registered<'_, V> {
        let mut waiting = lock(&self.waiting);
        // Random, so another party's answers never match by chance, and
        // a forger cannot guess which requests are out.
        let mut id = crate::util::random_u64();
        while id == 0 || waiting.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        waiting.insert(id, HashMap::default());
        Registered { requests: self, id }
    }

    /// Takes in what the node `node_id` answered to each request id in
    /// `answers`: for each request still waited on, with room, and no
    /// answer from that node yet (its first one stands), `value` makes what
    /// is kept. Whether anything was. An id longer than
    /// `MAX_NODE_ID_BYTES` names no node: nothing of it is kept.
    pub(super) fn answered<A>(
        &self,
        node_id: &str,
        answers: impl IntoIterator<Item = (u64, A)>,
        value: impl Fn(A) -> V,
    ) -> bool {
        if node_id.len() > MAX_NODE_ID_BYTES {
            return false;
        }
        let mut changed = false;
        let mut waiting = lock(&self.waiting);
        for (id, answer) in answers {
            if let Some(nodes) = waiting.get_mut(&id)
                && nodes.len() < MAX_ANSWERS
                && !nodes.contains_key(node_id)
            {
                nodes.insert(node_id.to_owned(), value(answer));
                changed = true;
            }
        }
        changed
    }

    /// The answers to the request `id` so far, by node.
    pub(super) fn answers(&self, id: u64) -> HashMap<String, V> {
        lock(&self.waiting).get(&id).cloned().unwrap_or_default()
    }
}

/// A request waited on; its answers go with it.
pub(super) struct Registered<'a, V> {
    requests: &'a Requests<V>,
    pub(super) id: u64,
}

impl<V> Drop for Registered<'_, V> {
    fn drop(&mut self) {
        lock(&self.requests.waiting).remove(&self.id);
    }
}

/// How a wait's request first goes out.
#[derive(Debug, Clone, Copy)]
pub(super) enum FirstSend {
    /// From a task of its own, not waited for; sent again after 100 ms.
    Spawned,
    /// At once, waited for before the answers are first looked at.
    Awaited,
}

/// When a request goes out again: after a first gap, then at doubling gaps
/// of at least 100 ms up to one heartbeat interval.
#[derive(Debug)]
struct Resend {
    gap: Duration,
    at: Instant,
}

impl Resend {
    /// Due `gap` after `started` (at once for a zero gap).
    fn first(started: Instant, gap: Duration) -> Self {
        Resend {
            gap,
            at: started.checked_add(gap).unwrap_or(started),
        }
    }

    /// Sent now: due again twice the last gap from now, at least
    /// `RESEND_FIRST`, at most `interval` (or `RESEND_FIRST`, if longer).
    fn sent(&mut self, interval: Duration) {
        self.gap = (self.gap.saturating_mul(2))
            .max(RESEND_FIRST)
            .min(interval.max(RESEND_FIRST));
        self.at = Instant::now().checked_add(self.gap).unwrap_or(self.at);
    }
}

/// A wait for the answers to one request, from its start.
pub(super) struct Wait {
    pub(super) started: Instant,
    deadline: Instant,
    /// Changes at every heartbeat and answer taken in.
    updates: watch::Receiver<u64>,
}

/// What a wait found: every live node that holds the cache, by id, with
/// its answer (`None`: none before the wait ended); from the start of the
/// wait until every node answered, or the timeout; and why the tally may
/// be missing a node, if it may.
pub(super) struct Gathered<V> {
    pub(super) nodes: Vec<(String, Option<V>)>,
    pub(super) elapsed: Duration,
    pub(super) incomplete: Option<Incomplete>,
}

impl Wait {
    /// Starts a wait of up to `timeout`, woken by what `cluster` takes in
    /// from now on.
    pub(super) fn start(cluster: &Cluster, timeout: Duration) -> Self {
        Wait {
            started: Instant::now(),
            deadline: deadline_after(timeout),
            updates: cluster.updates(),
        }
    }

    /// Sends `message` (a request or a probe), then again while nodes are
    /// missing, and waits until every live node that holds `cache` has an
    /// answer in `answers` (read at each look) and the view can be trusted
    /// to know every live node, or the timeout.
    pub(super) async fn gather<V: Clone>(
        mut self,
        cluster: &Cluster,
        cache: &str,
        mut message: Message,
        first: FirstSend,
        mut answers: impl FnMut() -> HashMap<String, V>,
    ) -> Gathered<V> {
        let started = self.started;
        // The channel may lose the request (a lossy transport, a node that
        // was subscribing as it went out), and a node may join during the
        // wait: sent again after 100 ms, then at doubling gaps up to one
        // heartbeat interval. Nodes answer every copy, so a lost answer is
        // made good too.
        let mut resend = match first {
            FirstSend::Spawned => {
                let (cluster, message) = (cluster.clone(), message.clone());
                tokio::spawn(async move { cluster.send(&message).await });
                Resend::first(started, RESEND_FIRST)
            }
            FirstSend::Awaited => Resend::first(started, Duration::ZERO),
        };
        loop {
            if Instant::now() >= resend.at {
                // Where answers should go may have changed meanwhile (the
                // reply channel broke, or came up).
                set_reply(&mut message, cluster.reads_replies());
                cluster.send(&message).await;
                resend.sent(cluster.interval());
            }
            let now = Instant::now();
            let answers = answers();
            let mut nodes: Vec<(String, Option<V>)> = cluster
                .holders(cache)
                .into_iter()
                .map(|node_id| {
                    let answer = answers.get(&node_id).cloned();
                    (node_id, answer)
                })
                .collect();
            nodes.sort_by(|a, b| a.0.cmp(&b.0));
            // Whether the view may be missing a live node, first: then no
            // tally of the nodes it knows can be complete.
            let incomplete = cluster.unsettled().or(if nodes.is_empty() {
                Some(Incomplete::NoNode)
            } else if nodes.iter().any(|(_, answer)| answer.is_none()) {
                Some(Incomplete::Pending)
            } else {
                None
            });
            if incomplete.is_none() || now >= self.deadline {
                return Gathered {
                    nodes,
                    elapsed: started.elapsed(),
                    incomplete,
                };
            }
            // Woken by every heartbeat and answer taken in, and at least
            // every few milliseconds besides: a view settles with nothing
            // arriving.
            let wake = now
                .checked_add(RECHECK)
                .unwrap_or(now)
                .min(self.deadline)
                .min(resend.at);
            tokio::select! {
                changed = self.updates.changed() => {
                    if changed.is_err() {
                        return Gathered {
                            nodes,
                            elapsed: started.elapsed(),
                            incomplete,
                        };
                    }
                }
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }
}

/// Says in a request or a probe whether this party reads its reply
/// channel now.
fn set_reply(message: &mut Message, reply: bool) {
    match message {
        Message::Request(r) => r.reply = reply,
        Message::Probe(p) => p.reply = reply,
        Message::Heartbeat(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use super::*;
    use crate::cluster::Request;
    use crate::cluster::tests::{cache, heartbeat, watcher};

    /// Each node's first answer to a request stands; answers to requests
    /// nobody waits on, or no longer, are not kept, and a wait that ends
    /// takes its answers with it.
    #[test]
    fn a_request_keeps_each_nodes_first_answer_while_it_is_waited_on() {
        let requests = Requests::<u32>::default();
        let a = requests.register();
        let b = requests.register();
        assert!(a.id != 0 && b.id != 0 && a.id != b.id);
        let unknown = (1..).find(|id| ![a.id, b.id].contains(id)).unwrap();
        let keep = |v| v;

        assert!(requests.answered("n1", [(a.id, 1)], keep));
        assert!(!requests.answered("n1", [(a.id, 2)], keep), "a duplicate");
        assert!(!requests.answered("n2", [(unknown, 3)], keep));
        // One answer may name several requests.
        assert!(requests.answered("n2", [(a.id, 4), (b.id, 5)], keep));
        let answers = requests.answers(a.id);
        assert_eq!((answers.len(), answers["n1"], answers["n2"]), (2, 1, 4));
        assert_eq!(requests.answers(b.id).len(), 1);
        assert!(requests.answers(unknown).is_empty());

        let late = a.id;
        drop(a);
        assert!(requests.answers(late).is_empty());
        assert!(!requests.answered("n3", [(late, 6)], keep), "a late answer");
        assert_eq!(lock(&requests.waiting).len(), 1, "only b is waited on");
        drop(b);
        assert!(lock(&requests.waiting).is_empty());
    }

    /// A request keeps no more answers than a view keeps members.
    /// An answer whose node id no view would keep is not taken, whichever
    /// kind of request it answers: forged answers cost a request at most
    /// `MAX_ANSWERS` ids of `MAX_NODE_ID_BYTES`.
    #[test]
    fn an_answer_from_an_overlong_node_id_is_not_taken() {
        let requests = Requests::<u32>::default();
        let a = requests.register();
        let longest = "n".repeat(MAX_NODE_ID_BYTES);
        let over = "n".repeat(MAX_NODE_ID_BYTES + 1);
        assert!(!requests.answered(&over, [(a.id, 1)], |v| v));
        assert!(requests.answers(a.id).is_empty());
        assert!(requests.answered(&longest, [(a.id, 2)], |v| v));
        assert_eq!(requests.answers(a.id)[&longest], 2);
    }

    #[test]
    fn a_request_keeps_at_most_as_many_answers_as_a_view_keeps_members() {
        let requests = Requests::<()>::default();
        let r = requests.register();
        for n in 0..MAX_ANSWERS {
            assert!(requests.answered(&format!("n{n}"), [(r.id, ())], |v| v));
        }
        assert!(!requests.answered("one more", [(r.id, ())], |v| v));
        assert_eq!(requests.answers(r.id).len(), MAX_ANSWERS);
        assert!(!requests.answers(r.id).contains_key("one more"));
    }

    /// When a request goes out, in ms from the start, sent as soon as due.
    async fn schedule(first: Duration, interval: Duration, sends: usize) -> Vec<u128> {
        let t0 = Instant::now();
        let mut resend = Resend::first(t0, first);
        let mut at = Vec::new();
        for _ in 0..sends {
            tokio::time::sleep_until(resend.at).await;
            at.push(t0.elapsed().as_millis());
            resend.sent(interval);
        }
        at
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_goes_out_again_at_doubling_gaps_up_to_the_interval() {
        let second = Duration::from_secs(1);
        // Its first copy spawned at the start, then these.
        let spawned = schedule(RESEND_FIRST, second, 6).await;
        assert_eq!(spawned, [100, 300, 700, 1500, 2500, 3500]);
        let awaited = schedule(Duration::ZERO, second, 6).await;
        assert_eq!(awaited, [0, 100, 300, 700, 1500, 2500]);
        // An interval below the first gap does not shorten it.
        let short = schedule(Duration::ZERO, Duration::from_millis(50), 4).await;
        assert_eq!(short, [0, 100, 200, 300]);
    }

    fn request(cluster: &Cluster) -> Message {
        let mut request = Request::roll_call(cluster.topic());
        request.cache = Some("c".into());
        Message::Request(request)
    }

    /// A view that is not reading the channel can never call a wait
    /// complete: it ends at its timeout, having sent its request again
    /// every interval (100 ms here), first copy spawned or awaited alike.
    #[tokio::test(start_paused = true)]
    async fn a_wait_sends_again_until_its_timeout() {
        for first in [FirstSend::Spawned, FirstSend::Awaited] {
            let c = watcher(None);
            let wait = Wait::start(&c, Duration::from_millis(350));
            let gathered = wait
                .gather(&c, "c", request(&c), first, HashMap::<String, ()>::default)
                .await;
            assert!(gathered.nodes.is_empty());
            assert_eq!(gathered.incomplete, Some(Incomplete::NotListening));
            assert_eq!(gathered.elapsed, Duration::from_millis(350));
            // At 0, 100, 200 and 300 ms.
            assert_eq!(c.stats().sent.load(Relaxed), 4, "{first:?}");
        }
    }

    /// A wait tallies every node that holds the cache, by id, with its
    /// answer or none, and ends as soon as every one answered.
    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_once_every_holder_answered() {
        let c = watcher(None);
        c.listening(true);
        tokio::time::advance(Duration::from_millis(200)).await;
        c.observe(heartbeat("n2", vec![cache("c", Some(1))]));
        c.observe(heartbeat("n1", vec![cache("c", Some(1))]));
        c.observe(heartbeat("n3", vec![cache("other", Some(1))]));
        assert_eq!(c.unsettled(), None);
        let n1 = || HashMap::from_iter([("n1".to_owned(), 7)]);

        let wait = Wait::start(&c, Duration::from_millis(50));
        let gathered = wait
            .gather(&c, "c", request(&c), FirstSend::Awaited, n1)
            .await;
        assert_eq!(
            gathered.nodes,
            [("n1".to_owned(), Some(7)), ("n2".to_owned(), None)]
        );
        assert_eq!(gathered.incomplete, Some(Incomplete::Pending));
        assert_eq!(gathered.elapsed, Duration::from_millis(50));

        // n2's answer comes in after the first look, which was 10 ms ago
        // when the wait looks again.
        let mut looks = 0;
        let wait = Wait::start(&c, Duration::from_secs(5));
        let gathered = wait
            .gather(&c, "c", request(&c), FirstSend::Awaited, || {
                looks += 1;
                let mut answers = n1();
                if looks > 1 {
                    answers.insert("n2".to_owned(), 8);
                }
                answers
            })
            .await;
        assert_eq!(
            gathered.nodes,
            [("n1".to_owned(), Some(7)), ("n2".to_owned(), Some(8))]
        );
        assert_eq!(gathered.incomplete, None);
        assert_eq!(gathered.elapsed, RECHECK);
        assert_eq!(looks, 2);
    }
}
