//! A `nats-server -js` of the test's own, on a free loopback port with a
//! temporary store, that the test can kill, restart on the same store, and
//! pause.

use std::io::Read;
use std::net::TcpStream;
use std::process::{Command, Stdio};

use crate::process::ServerProcess;
use std::time::{Duration, Instant};

use crate::redis_server::free_port;

/// A running `nats-server` with JetStream, stopped on drop.
#[derive(Debug)]
pub struct NatsServer {
    port: u16,
    dir: tempfile::TempDir,
    process: ServerProcess,
}

const MISSING: &str = "nats-server is not on PATH. Install it (Debian: `apt-get install nats-server`); \
                       ./scripts/test installs it when it is missing";

impl NatsServer {
    /// Starts a server with JetStream and file storage in a temp dir.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir for nats-server");
        let mut server = Self {
            port: free_port(),
            dir,
            process: ServerProcess::default(),
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("nats.log")).expect("log file");
        let mut cmd = Command::new("nats-server");
        cmd.args([
            "-a",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-js",
            "-sd",
        ])
        .arg(self.dir.path().join("store"))
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
        while !self.greets() {
            if let Some(status) = self.process.exited() {
                panic!("nats-server exited with {status}; log:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "nats-server did not start in 10 s; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn greets(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 4];
        stream.read_exact(&mut buf).is_ok() && &buf == b"INFO"
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats.log")).unwrap_or_default()
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
        self.spawn();
    }

    /// `kill -9`, then starts again on the same port with an empty store:
    /// every stream is gone, and made again from sequence 1 on first use.
    pub fn wipe(&mut self) {
        self.kill();
        let store = self.dir.path().join("store");
        if store.exists() {
            std::fs::remove_dir_all(&store).expect("remove the nats store");
        }
        self.spawn();
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
