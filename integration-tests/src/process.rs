//! The child process behind a test server harness: killed, paused and
//! resumed on request, and never left running (or stopped) after a test.

use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// A server process; killed on drop.
#[derive(Debug, Default)]
pub(crate) struct ServerProcess(Option<Child>);

impl ServerProcess {
    pub(crate) fn set(&mut self, child: Child) {
        self.0 = Some(child);
    }

    /// Its exit status, if it has already exited.
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        self.0.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// `kill -9`, and reaps it.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP: it keeps its connections open but answers nothing.
    pub(crate) fn pause(&self) {
        signal("-STOP", self.running_pid());
    }

    /// SIGCONT.
    pub(crate) fn resume(&self) {
        signal("-CONT", self.running_pid());
    }

    /// Its process id, if it was started and not killed.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.0.as_ref().map(Child::id)
    }

    fn running_pid(&self) -> u32 {
        self.pid().expect("server is running")
    }
}

/// CPU time (user and system) process `pid` has used, from
/// `/proc/<pid>/stat`, in the kernel's user-visible ticks of 10 ms
/// (`USER_HZ`, 100 on every Linux).
pub(crate) fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name, which may hold spaces, in parentheses.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the line (utime, stime); `rest` starts at field 3.
    let user = fields.get(11)?.parse::<u64>().ok()?;
    let system = fields.get(12)?.parse::<u64>().ok()?;
    let ticks = user.checked_add(system)?;
    Some(Duration::from_millis(ticks.saturating_mul(10)))
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // A stopped process would outlive the test; continue it before the
        // kill. Not one that has exited (a server that failed to start):
        // `kill` would fail on it, and a panic here, during the test's own
        // panic, aborts the test before the other servers are killed.
        // Quietly even so: it may exit between the check and the signal.
        if self.exited().is_none()
            && let Some(child) = self.0.as_ref()
        {
            let _ = try_signal("-CONT", child.id());
        }
        self.kill();
    }
}

/// Starts a server on fresh ports until `attempt` succeeds, at most
/// `ATTEMPTS` times. A port found free can be taken before the server
/// binds it, by another test's server or as the local port of an outgoing
/// connection (each broker test makes hundreds); `attempt` says so with an
/// `Err`, and panics on any other failure.
pub(crate) fn start_on_free_ports<T>(
    what: &str,
    mut attempt: impl FnMut() -> Result<T, String>,
) -> T {
    const ATTEMPTS: u32 = 5;
    let mut taken = Vec::new();
    for n in 1..=ATTEMPTS {
        match attempt() {
            Ok(server) => return server,
            Err(why) => {
                eprintln!("{what}: {why}; starting again on other ports ({n}/{ATTEMPTS})");
                taken.push(why);
            }
        }
    }
    panic!("{what}: a port was taken on each of {ATTEMPTS} tries: {taken:?}");
}

/// Whether a server's log says its listen address was taken.
pub(crate) fn says_port_taken(log: &str) -> bool {
    log.to_ascii_lowercase().contains("address already in use")
}

/// Sends a signal with `kill`: no unsafe code needed.
pub fn signal(sig: &str, pid: u32) {
    assert!(try_signal(sig, pid), "kill {sig} {pid} failed");
}

/// Sends a signal, saying whether it was delivered. For drops: a panic
/// there, during a failed test's own panic, aborts the whole test binary
/// before its other servers are killed.
pub(crate) fn try_signal(sig: &str, pid: u32) -> bool {
    Command::new("kill")
        .arg(sig)
        .arg(pid.to_string())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
