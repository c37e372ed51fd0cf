//! The processes the chaos run starts — members of the group and replays — and nothing
//! else: each one's PID is in a file under `<work>/pids` while it runs, so that
//! `scripts/chaos` can stop exactly these after the driver itself was killed, and the
//! driver only ever signals PIDs it spawned.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

/// The PIDs of the children alive, mirrored in files.
#[derive(Clone)]
pub struct Pids {
    dir: PathBuf,
    live: Arc<Mutex<BTreeMap<u32, String>>>,
}

impl Pids {
    pub fn new(dir: PathBuf) -> Result<Pids> {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Pids { dir, live: Arc::default() })
    }

    fn register(&self, pid: u32, label: &str) {
        let _ = std::fs::write(self.dir.join(format!("{label}.pid")), format!("{pid}\n"));
        self.live.lock().expect("not poisoned").insert(pid, label.to_string());
    }

    fn unregister(&self, pid: u32) {
        if let Some(label) = self.live.lock().expect("not poisoned").remove(&pid) {
            let _ = std::fs::remove_file(self.dir.join(format!("{label}.pid")));
        }
    }

    /// SIGKILL to every child still alive (an interrupted run).
    pub fn kill_all(&self) {
        for (&pid, _) in self.live.lock().expect("not poisoned").iter() {
            signal(pid, libc::SIGKILL);
        }
    }
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) takes two integers and touches no memory of ours. Which process
    // it reaches is the callers' concern: only PIDs of children not yet reaped (a
    // child's PID cannot be reused before its parent waits for it), or reaped a moment
    // ago in `Pids`, far too recently for the kernel to have handed the number out again.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// How to start the children: the `clickagg` binary and the settings every child gets.
#[derive(Clone)]
pub struct Launcher {
    pub bin: PathBuf,
    pub env: Vec<(String, String)>,
    pub logs: PathBuf,
    pub pids: Pids,
}

/// A running child whose output goes to a log file.
pub struct Process {
    pub label: String,
    pub pid: u32,
    pub log: PathBuf,
    child: Child,
    pids: Pids,
    /// What its log said of its flushes so far.
    pub flushes: watch::Receiver<Flushes>,
}

/// A member's flushes as its log tells them: the sink's debug line "flushing" comes
/// right before a flush's inserts, the flusher's "flushed" once they are durable (and
/// before its offsets are committed), "flush failed" when they were not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flushes {
    /// "flushing" lines of flushes that write rows (one of commits alone takes no time).
    pub started: u64,
    /// A flush started and neither completed nor failed since.
    pub in_flight: bool,
    /// Its log ended (the process exited): nothing more will change.
    pub ended: bool,
}

impl Flushes {
    fn read(&mut self, line: &str) {
        if line.contains(r#""message":"flushing""#) && !line.contains(r#""rows":0,"#) {
            self.started += 1;
            self.in_flight = true;
        } else if line.contains(r#""message":"flushed""#) || line.contains("flush failed") {
            self.in_flight = false;
        }
    }
}

impl Launcher {
    pub fn spawn(&self, label: &str, args: &[&str], extra_env: &[(String, String)]) -> Result<Process> {
        let log = self.logs.join(format!("{label}.log"));
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(Stdio::piped())
            // Its own process group: a terminal's Ctrl-C reaches the driver alone,
            // which then stops exactly its children.
            .process_group(0)
            .kill_on_drop(true);
        for (k, _) in std::env::vars() {
            if k.starts_with("CLICKAGG__") || k == "RUST_LOG" {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.env.iter().chain(extra_env).map(|(k, v)| (k, v)));
        let mut child = cmd.spawn().with_context(|| format!("starting {}", self.bin.display()))?;
        let pid = child.id().context("a child just spawned has a PID")?;
        self.pids.register(pid, label);
        let (tx, rx) = watch::channel(Flushes::default());
        let stderr = child.stderr.take().context("stderr is piped")?;
        let mut file = std::fs::OpenOptions::new().append(true).open(&log)?;
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tx.send_if_modified(|f| {
                    let before = *f;
                    f.read(&line);
                    *f != before
                });
                let _ = writeln!(file, "{line}");
            }
            tx.send_modify(|f| f.ended = true);
        });
        Ok(Process { label: label.to_string(), pid, log, child, pids: self.pids.clone(), flushes: rx })
    }
}

impl Process {
    /// SIGKILL, and reap it. Returns what its log says of its flushes, complete (up
    /// to a few seconds for the rest of its output to be read).
    pub async fn kill(mut self) -> Flushes {
        signal(self.pid, libc::SIGKILL);
        let _ = self.child.wait().await;
        self.pids.unregister(self.pid);
        let mut rx = self.flushes.clone();
        let _ = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|f| f.ended)).await;
        let flushes = *rx.borrow();
        flushes
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`): a member frozen past its session timeout
    /// comes back as a zombie. Only while this process is ours and not reaped.
    pub fn freeze(&mut self, frozen: bool) {
        if matches!(self.child.try_wait(), Ok(None)) {
            signal(self.pid, if frozen { libc::SIGSTOP } else { libc::SIGCONT });
        }
    }

    /// SIGTERM, and its exit code once it exits (`None`: killed after `timeout`, or by
    /// a signal).
    pub async fn terminate(mut self, timeout: Duration) -> Option<i32> {
        signal(self.pid, libc::SIGTERM);
        let code = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(Ok(status)) => status.code(),
            _ => {
                signal(self.pid, libc::SIGKILL);
                let _ = self.child.wait().await;
                None
            }
        };
        self.pids.unregister(self.pid);
        code
    }

    /// Its exit code once it exits by itself.
    pub async fn wait(mut self) -> Option<i32> {
        let code = self.child.wait().await.ok().and_then(|s| s.code());
        self.pids.unregister(self.pid);
        code
    }

    /// `Some(exit code)` if it has exited (reaped here); `None` while it runs.
    pub fn exited(&mut self) -> Option<Option<i32>> {
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.pids.unregister(self.pid);
                Some(status.code())
            }
            _ => None,
        }
    }
}

/// The last `n` lines of a log, for a report.
pub fn tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Resident memory of a process from `/proc/<pid>/status`: (VmRSS, VmHWM) in KiB.
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    parse_status(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

fn parse_status(status: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_is_in_flight_from_flushing_with_rows_until_flushed_or_failed() {
        let mut f = Flushes::default();
        let line = |m: &str, rows: u32| format!(r#"{{"level":"DEBUG","message":"{m}","rows":{rows},"target":"x"}}"#);
        f.read(&line("flushing", 0));
        assert_eq!((f.started, f.in_flight), (0, false), "a flush of commits alone does not count");
        f.read(&line("flushing", 12));
        assert_eq!((f.started, f.in_flight), (1, true));
        f.read(&line("flushed", 12));
        assert!(!f.in_flight);
        f.read(&line("flushing", 3));
        f.read(r#"{"level":"WARN","message":"flush failed; keeping the rows and retrying"}"#);
        assert_eq!((f.started, f.in_flight), (2, false));
    }

    #[test]
    fn resident_memory_is_read_from_proc_status() {
        let status = "Name:\tclickagg\nVmPeak:\t  900000 kB\nVmHWM:\t  123456 kB\nVmRSS:\t  100000 kB\nThreads:\t9\n";
        assert_eq!(parse_status(status), Some((100_000, 123_456)));
        assert_eq!(parse_status("Name:\tzombie\n"), None);
        assert!(memory_kib(std::process::id()).is_some_and(|(rss, hwm)| rss > 0 && hwm >= rss));
    }
}
