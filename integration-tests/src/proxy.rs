//! A fault-injecting TCP proxy on loopback, between a client and one
//! server, in the manner of Toxiproxy: the partitions the suite needs
//! without root or `tc` (see `docs/design.md`, "Partitions").
//!
//! A cut link neither closes nor resets anything: the proxy stops moving
//! bytes in the cut direction and keeps what it read, so each side sees
//! what a real partition shows it (writes accepted by its own kernel,
//! nothing answered, no error until its own timeouts fire), and a healed
//! link delivers the held bytes in order, as TCP's retransmissions would.
//! A connection opened while the link is cut is accepted (the kernel
//! would take the handshake into the backlog) and relays nothing until the
//! heal.
//!
//! A cut can also be of some clients only, told apart by their source
//! address ([`Proxy::cut_sources`]): servers of a cluster that each dial
//! their peers from a loopback address of their own (Redis's
//! `bind-source-addr`) can be cut from one another while every client
//! still reaches them, through one proxy in front of each server.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What the link does now, in each direction.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Link {
    /// Client → server bytes move.
    up: bool,
    /// Server → client bytes move.
    down: bool,
    /// Added to every chunk, from the moment the proxy read it.
    latency: Duration,
    /// Bumped by [`Proxy::reset`]: connections of an older epoch end.
    epoch: u64,
    /// Connections from these addresses move nothing either way, whatever
    /// `up` and `down` say.
    cut_sources: Arc<[IpAddr]>,
}

impl Link {
    fn open(&self, direction: Direction, source: IpAddr) -> bool {
        if self.cut_sources.contains(&source) {
            return false;
        }
        match direction {
            Direction::Up => self.up,
            Direction::Down => self.down,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Direction {
    Up,
    Down,
}

/// A proxy in front of one server. Dropping it closes every connection.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    link: watch::Sender<Link>,
    /// Connections accepted so far, for tests that want to know one was
    /// made through the proxy.
    accepted: Arc<AtomicU64>,
    accept: JoinHandle<()>,
    flapping: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Proxy {
    /// Listens on a free loopback port and relays every connection to
    /// `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy on loopback");
        let addr = listener.local_addr().expect("proxy address");
        let (link, watching) = watch::channel(Link {
            up: true,
            down: true,
            latency: Duration::ZERO,
            epoch: 0,
            cut_sources: Arc::new([]),
        });
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = accepted.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, from)) = listener.accept().await {
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(relay(client, from.ip(), upstream, watching.clone()));
            }
        });
        Self {
            addr,
            link,
            accepted,
            accept,
            flapping: std::sync::Mutex::new(None),
        }
    }

    /// Where clients connect instead of the server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    fn set(&self, f: impl FnOnce(&mut Link)) {
        self.link.send_modify(f);
    }

    /// Cuts both directions without closing anything.
    pub fn blackhole(&self) {
        self.stop_flapping();
        self.set(|l| {
            l.up = false;
            l.down = false;
        });
    }

    /// Cuts one direction only: `up` the client's bytes to the server,
    /// else the server's answers to the client.
    pub fn cut_one_way(&self, up: bool) {
        self.stop_flapping();
        self.set(|l| {
            l.up = !up;
            l.down = up;
        });
    }

    /// Adds `latency` to every chunk in both directions (zero: none).
    pub fn latency(&self, latency: Duration) {
        self.set(|l| l.latency = latency);
    }

    /// Cuts both directions of every connection from one of `sources`
    /// (opened before or after), closing nothing; others move as before.
    pub fn cut_sources(&self, sources: &[IpAddr]) {
        self.set(|l| l.cut_sources = sources.into());
    }

    /// Restores both directions, for every source, and delivers what was
    /// held.
    pub fn heal(&self) {
        self.stop_flapping();
        self.set(|l| {
            l.up = true;
            l.down = true;
            l.cut_sources = Arc::new([]);
        });
    }

    /// Resets every open connection (new ones are relayed as before).
    pub fn reset(&self) {
        self.set(|l| l.epoch += 1);
    }

    /// Cuts and heals both directions in turn, every `period`, until
    /// [`Proxy::heal`] (or another cut) stops it.
    pub fn flap(&self, period: Duration) {
        self.stop_flapping();
        let link = self.link.clone();
        let task = tokio::spawn(async move {
            let mut cut = false;
            loop {
                cut = !cut;
                link.send_modify(|l| {
                    l.up = !cut;
                    l.down = !cut;
                });
                tokio::time::sleep(period).await;
            }
        });
        *self.flapping.lock().expect("flapping lock") = Some(task);
    }

    fn stop_flapping(&self) {
        if let Some(task) = self.flapping.lock().expect("flapping lock").take() {
            task.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop_flapping();
        self.accept.abort();
        // Ends every relay: their epoch is gone.
        self.link.send_modify(|l| l.epoch = u64::MAX);
    }
}

async fn relay(
    client: TcpStream,
    source: IpAddr,
    upstream: SocketAddr,
    mut link: watch::Receiver<Link>,
) {
    let epoch = link.borrow_and_update().epoch;
    // The server is dialled only once the client's bytes may pass: a
    // partitioned client's connection never reaches it.
    if !wait_open(&mut link, Direction::Up, source, epoch, None).await {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        // The server is down: the client sees its connection closed, as a
        // refused connection through the proxy.
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // An ended epoch resets rather than closes: linger zero sends RST. (The
    // deprecation is about a non-zero linger blocking the thread on drop;
    // zero never waits.)
    #[allow(deprecated)]
    {
        let _ = client.set_linger(Some(Duration::ZERO));
        let _ = server.set_linger(Some(Duration::ZERO));
    }
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = tokio::spawn(pump(
        client_read,
        server_write,
        (Direction::Up, source),
        link.clone(),
        epoch,
    ));
    let down = tokio::spawn(pump(
        server_read,
        client_write,
        (Direction::Down, source),
        link,
        epoch,
    ));
    let _ = tokio::join!(up, down);
}

/// Waits until `direction` is open (and, with `due`, until then); false
/// once the epoch ended.
async fn wait_open(
    link: &mut watch::Receiver<Link>,
    direction: Direction,
    source: IpAddr,
    epoch: u64,
    arrived: Option<Instant>,
) -> bool {
    loop {
        let now = link.borrow_and_update().clone();
        if now.epoch != epoch {
            return false;
        }
        if now.open(direction, source) {
            let Some(arrived) = arrived else {
                return true;
            };
            let due = arrived + now.latency;
            if Instant::now() >= due {
                return true;
            }
            // Latency changed or the link cut while waiting: look again.
            tokio::select! {
                () = tokio::time::sleep_until(due) => {}
                changed = link.changed() => if changed.is_err() { return false },
            }
            continue;
        }
        if link.changed().await.is_err() {
            return false;
        }
    }
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    (direction, source): (Direction, IpAddr),
    mut link: watch::Receiver<Link>,
    epoch: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            read = from.read(&mut buf) => read,
            () = ended(link.clone(), epoch) => return,
        };
        let n = match read {
            Ok(0) | Err(_) => {
                // The sender closed: pass the close on once the link lets
                // bytes through (a FIN is a packet too).
                if wait_open(&mut link, direction, source, epoch, Some(Instant::now())).await {
                    let _ = to.shutdown().await;
                }
                return;
            }
            Ok(n) => n,
        };
        // Held here while the link is cut: the proxy reads no more, so the
        // sender's kernel buffers fill, as they would with packets unacked.
        if !wait_open(&mut link, direction, source, epoch, Some(Instant::now())).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Resolves once `epoch` has ended.
async fn ended(mut link: watch::Receiver<Link>, epoch: u64) {
    loop {
        if link.borrow_and_update().epoch != epoch {
            return;
        }
        if link.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn echoes(c: &mut TcpStream, within: Duration) -> bool {
        c.write_all(b"ping").await.expect("write");
        let mut buf = [0u8; 4];
        matches!(
            tokio::time::timeout(within, c.read_exact(&mut buf)).await,
            Ok(Ok(4))
        )
    }

    #[tokio::test]
    async fn cuts_hold_bytes_and_heals_deliver_them() {
        let proxy = Proxy::start(echo_server().await).await;
        let mut c = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert!(echoes(&mut c, Duration::from_secs(5)).await);

        proxy.blackhole();
        assert!(!echoes(&mut c, Duration::from_millis(200)).await);
        // A connection opened during the cut is accepted and answers nothing.
        let mut late = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert!(!echoes(&mut late, Duration::from_millis(200)).await);
        proxy.heal();
        // The held "ping" of the cut, then the next one: nothing lost.
        let mut buf = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut buf))
            .await
            .expect("the held bytes arrive")
            .expect("read");
        assert!(echoes(&mut c, Duration::from_secs(5)).await);
        assert_eq!(proxy.accepted(), 2);

        for up in [true, false] {
            proxy.cut_one_way(up);
            assert!(!echoes(&mut c, Duration::from_millis(200)).await, "up {up}");
            proxy.heal();
            tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut buf))
                .await
                .expect("the held bytes arrive")
                .expect("read");
        }

        proxy.latency(Duration::from_millis(300));
        let sent = Instant::now();
        assert!(echoes(&mut c, Duration::from_secs(5)).await);
        // Each direction adds it once.
        assert!(sent.elapsed() >= Duration::from_millis(600));
        proxy.latency(Duration::ZERO);

        proxy.reset();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "a reset connection ends");
        let mut fresh = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert!(echoes(&mut fresh, Duration::from_secs(5)).await);
    }

    /// Dials `to` from `source`, as a server with `bind-source-addr` does.
    async fn connect_from(source: IpAddr, to: SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new(source, 0))
            .expect("bind the source");
        socket.connect(to).await.expect("connect")
    }

    #[tokio::test]
    async fn a_cut_of_some_sources_leaves_the_others_moving() {
        let proxy = Proxy::start(echo_server().await).await;
        let peer: IpAddr = "127.0.0.2".parse().unwrap();
        let client: IpAddr = "127.0.0.1".parse().unwrap();
        let mut from_peer = connect_from(peer, proxy.addr()).await;
        let mut from_client = connect_from(client, proxy.addr()).await;
        assert!(echoes(&mut from_peer, Duration::from_secs(5)).await);

        proxy.cut_sources(&[peer]);
        assert!(!echoes(&mut from_peer, Duration::from_millis(200)).await);
        assert!(echoes(&mut from_client, Duration::from_secs(5)).await);
        // A connection the peer opens during the cut relays nothing either.
        let mut late = connect_from(peer, proxy.addr()).await;
        assert!(!echoes(&mut late, Duration::from_millis(200)).await);

        proxy.heal();
        let mut buf = [0u8; 4];
        for c in [&mut from_peer, &mut late] {
            tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut buf))
                .await
                .expect("the held bytes arrive")
                .expect("read");
            assert!(echoes(c, Duration::from_secs(5)).await);
        }
    }
}
