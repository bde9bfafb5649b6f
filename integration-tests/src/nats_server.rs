//! A `nats-server -js` of the test's own, on a free loopback port with a
//! temporary store, that the test can kill, restart on the same store, and
//! pause.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::process::{ServerProcess, says_port_taken, start_on_free_ports};
use std::time::{Duration, Instant};

use crate::redis_server::free_port;

/// A running `nats-server` with JetStream, stopped on drop.
#[derive(Debug)]
pub struct NatsServer {
    name: String,
    port: u16,
    dir: tempfile::TempDir,
    process: ServerProcess,
    /// More arguments: a cluster member's routes and monitoring port.
    extra: Vec<String>,
}

const MISSING: &str = "nats-server is not on PATH. Install it (Debian: `apt-get install nats-server`); \
                       ./scripts/test installs it when it is missing";

/// A server name no other server of any test has.
fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "cache-sync-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl NatsServer {
    /// Starts a server with JetStream and file storage in a temp dir.
    pub fn start() -> Self {
        start_on_free_ports("nats-server", || {
            let mut server = Self {
                name: unique_name(),
                port: free_port(),
                dir: tempfile::tempdir().expect("temp dir for nats-server"),
                process: ServerProcess::default(),
                extra: Vec::new(),
            };
            server.spawn().map(|()| server)
        })
    }

    /// Starts a server on `port` with `extra` arguments (a cluster
    /// member's); `Err` when one of its ports is taken.
    pub(crate) fn start_with(port: u16, extra: Vec<String>) -> Result<Self, String> {
        let mut server = Self {
            name: unique_name(),
            port,
            dir: tempfile::tempdir().expect("temp dir for nats-server"),
            process: ServerProcess::default(),
            extra,
        };
        server.spawn().map(|()| server)
    }

    /// The server's name (`server_name`), as the cluster reports it.
    pub fn server_name(&self) -> &str {
        &self.name
    }

    /// Unique to this server (kept over restarts), so its greeting tells it
    /// from another test's server on a port taken from under it.
    fn name(&self) -> &str {
        &self.name
    }

    /// Starts the server on its port; `Err` when another process has it.
    fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.path().join("nats.log")).expect("log file");
        let mut cmd = Command::new("nats-server");
        cmd.args([
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-js",
            "--server_name",
            self.name(),
            "-sd",
        ])
        .arg(self.dir.path().join("store"))
        .args(&self.extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log);
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
            Err(e) => panic!("cannot start nats-server: {e}"),
        };
        self.process.set(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        // The server greets every client with an INFO line once it is ready.
        loop {
            if let Some(info) = self.greeting() {
                if info.contains(&format!("\"server_name\":\"{}\"", self.name)) {
                    return Ok(());
                }
                self.process.kill();
                return Err(format!("another server answers on port {}", self.port));
            }
            if let Some(status) = self.process.exited() {
                let log = self.log();
                if says_port_taken(&log) {
                    return Err(format!("port {} was taken", self.port));
                }
                panic!("nats-server exited with {status}; log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "nats-server did not start in 10 s; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The INFO line every client is greeted with once the server is ready.
    fn greeting(&self) -> Option<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let mut line = String::new();
        BufReader::new(&mut stream).read_line(&mut line).ok()?;
        line.starts_with("INFO").then_some(line)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats.log")).unwrap_or_default()
    }

    /// Its loopback address, for a proxy in front of it.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn().unwrap_or_else(|e| panic!("nats-server: {e}"));
    }

    /// `kill -9`, then starts again on the same port with an empty store:
    /// every stream is gone, and made again from sequence 1 on first use.
    pub fn wipe(&mut self) {
        self.kill();
        let store = self.dir.path().join("store");
        if store.exists() {
            std::fs::remove_dir_all(&store).expect("remove the nats store");
        }
        self.spawn().unwrap_or_else(|e| panic!("nats-server: {e}"));
    }

    /// SIGSTOP.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.process.resume();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port another server holds is reported as taken (for a start on
    /// other ports), never taken for this server's.
    #[test]
    fn a_taken_port_is_noticed() {
        let other = NatsServer::start();
        let mut second = NatsServer {
            name: unique_name(),
            port: other.port,
            dir: tempfile::tempdir().expect("temp dir"),
            process: ServerProcess::default(),
            extra: Vec::new(),
        };
        let taken = second.spawn();
        assert!(taken.is_err(), "started on a port another server holds");
        assert!(other.greeting().is_some(), "the other server was disturbed");
    }
}
