//! The child process behind a test server harness: killed, paused and
//! resumed on request, and never left running (or stopped) after a test.

use std::process::{Child, Command, ExitStatus};

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
        signal("-STOP", self.pid());
    }

    /// SIGCONT.
    pub(crate) fn resume(&self) {
        signal("-CONT", self.pid());
    }

    fn pid(&self) -> u32 {
        self.0.as_ref().expect("server is running").id()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // A stopped process would outlive the test; continue it before the
        // kill. Not one that has exited (a server that failed to start):
        // `kill` would fail on it, and a panic here, during the test's own
        // panic, aborts the test before the other servers are killed.
        if self.exited().is_none()
            && let Some(child) = self.0.as_ref()
        {
            signal("-CONT", child.id());
        }
        self.kill();
    }
}

/// Sends a signal with `kill`: no unsafe code needed.
pub fn signal(sig: &str, pid: u32) {
    let status = Command::new("kill")
        .arg(sig)
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid} failed");
}
