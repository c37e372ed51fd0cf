//! The process harness: the real `clickagg` binary as a child process that a test can
//! SIGTERM or SIGKILL, with its output captured line by line.
//!
//! Two rules keep it deterministic:
//! - **Exited means complete.** [`Member::wait`] returns only after the child exited
//!   *and* both of its streams reached end of file, so everything it printed is in
//!   [`Member::output`]. (Returning at the exit alone raced the reader threads: the
//!   tail of the output could be missing under load.)
//! - **No PID reuse.** The child is reaped only after the harness noted that it exited
//!   (`waitid(WNOWAIT)` first), and signals are sent only while it has not, so a signal
//!   can never reach another process that inherited the PID.
//!
//! Output is read by plain threads, not by tasks of the test's runtime: a test that
//! blocks a worker (a synchronous Kafka call) must never stop a child's pipe from
//! draining, or the child would block on a full pipe.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::http::{http_get, metric_value};

/// What the harness knows about a child, published to waiters on every change.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    lines: usize,
    /// Output streams not yet at end of file.
    open_streams: u8,
    /// The exit code once the child exited (-1: killed by a signal).
    exit: Option<i32>,
}

struct Shared {
    lines: Mutex<Vec<String>>,
    progress: watch::Sender<Progress>,
    /// Set under this lock before the child is reaped; signals are sent under it too.
    exited: Mutex<bool>,
}

/// A running (or finished) `clickagg` child process and its captured output.
pub struct Member {
    pub label: String,
    pid: i32,
    shared: Arc<Shared>,
    pub log_path: PathBuf,
}

impl Member {
    /// Starts `cmd` (stdout and stderr are captured here) and mirrors its output to `log_path`.
    pub fn start(label: &str, mut cmd: Command, log_path: PathBuf) -> Member {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child: Child = cmd.spawn().expect("spawn clickagg");
        let pid = child.id() as i32;
        let (progress, _) = watch::channel(Progress { open_streams: 2, ..Progress::default() });
        let shared = Arc::new(Shared { lines: Mutex::new(Vec::new()), progress, exited: Mutex::new(false) });
        let file = Arc::new(Mutex::new(std::fs::File::create(&log_path).expect("create member log")));
        let streams: [Box<dyn Read + Send>; 2] =
            [Box::new(child.stderr.take().expect("piped")), Box::new(child.stdout.take().expect("piped"))];
        for stream in streams {
            let (shared, file) = (shared.clone(), file.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = writeln!(file.lock().unwrap(), "{line}");
                    shared.lines.lock().unwrap().push(line);
                    shared.progress.send_modify(|p| p.lines += 1);
                }
                shared.progress.send_modify(|p| p.open_streams -= 1);
            });
        }
        let waiter = shared.clone();
        std::thread::spawn(move || {
            // Wait for the exit without reaping, so the PID stays ours until `exited` is set.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT) };
            *waiter.exited.lock().unwrap() = true;
            let code = child.wait().map(|s| s.code().unwrap_or(-1)).unwrap_or(-1);
            waiter.progress.send_modify(|p| p.exit = Some(code));
        });
        Member { label: label.to_string(), pid, shared, log_path }
    }

    /// Every line printed so far. Complete once [`wait`](Self::wait) has returned.
    pub fn lines(&self) -> Vec<String> {
        self.shared.lines.lock().unwrap().clone()
    }

    pub fn output(&self) -> String {
        self.lines().join("\n")
    }

    /// Sends `sig` unless the child already exited.
    pub fn signal(&self, sig: i32) {
        let exited = self.shared.exited.lock().unwrap();
        if !*exited {
            unsafe {
                libc::kill(self.pid, sig);
            }
        }
    }

    /// Waits until a line containing `needle` was printed after line `from`; returns the
    /// number of lines seen up to and including it. Panics if the child's output ends
    /// first, or after `timeout`.
    pub async fn wait_for_line(&self, needle: &str, from: usize, timeout: Duration) -> usize {
        let mut rx = self.shared.progress.subscribe();
        let mut found = None;
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|p| {
                let lines = self.shared.lines.lock().unwrap();
                found = lines.iter().skip(from).position(|l| l.contains(needle)).map(|i| from + i + 1);
                found.is_some() || p.open_streams == 0
            }),
        )
        .await
        .map(|r| r.map(drop));
        match (waited, found) {
            (_, Some(n)) => n,
            (Ok(_), None) => panic!(
                "{}: exited without printing {needle:?}; log {}\n{}",
                self.label,
                self.log_path.display(),
                self.tail(20)
            ),
            (Err(_), None) => {
                panic!("{}: no line with {needle:?} within {timeout:?}; log {}", self.label, self.log_path.display())
            }
        }
    }

    /// Waits for the exit and for the end of both output streams; returns the exit code
    /// (-1 when killed by a signal). Past `timeout` the child is killed and the test fails.
    pub async fn wait(&mut self, timeout: Duration) -> i32 {
        let mut rx = self.shared.progress.subscribe();
        let done = tokio::time::timeout(timeout, rx.wait_for(|p| p.exit.is_some() && p.open_streams == 0))
            .await
            .map(|r| r.map(|p| p.exit));
        match done {
            Ok(Ok(exit)) => exit.expect("checked"),
            Ok(Err(_)) => unreachable!("the sender lives in self.shared"),
            Err(_) => {
                self.signal(libc::SIGKILL);
                panic!(
                    "{} did not exit (and close its output) within {timeout:?}; log {}",
                    self.label,
                    self.log_path.display()
                );
            }
        }
    }

    /// SIGKILL, then wait for the exit (and the end of the output).
    pub async fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        self.wait(Duration::from_secs(30)).await;
    }

    /// SIGTERM, then wait for the exit code.
    pub async fn terminate(&mut self, timeout: Duration) -> i32 {
        self.signal(libc::SIGTERM);
        self.wait(timeout).await
    }

    /// The last `n` lines, for failure messages.
    pub fn tail(&self, n: usize) -> String {
        let lines = self.lines();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The address of this member's HTTP server, from its start-up log line.
    pub async fn http_addr(&self) -> String {
        let n = self.wait_for_line("serving /metrics", 0, Duration::from_secs(60)).await;
        let line = self.lines()[n - 1].clone();
        let v: serde_json::Value = serde_json::from_str(&line).expect("JSON log line");
        v["addr"].as_str().expect("addr field").to_string()
    }

    /// GET `path` from the member's HTTP server: (status, body).
    pub async fn http_get(&self, path: &str) -> (u16, String) {
        http_get(&self.http_addr().await, path).await
    }

    /// The value of a metric (`name{labels} value`) summed over label sets that contain
    /// every `label_filter`.
    pub async fn metric(&self, name: &str, label_filter: &[&str]) -> f64 {
        let (_, body) = self.http_get("/metrics").await;
        metric_value(&body, name, label_filter)
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
    }
}

/// Polls the member's `/readyz` until its status is `want`; returns the body.
pub async fn wait_ready(member: &Member, want: u16, timeout: std::time::Duration) -> String {
    super::wait_until(&format!("/readyz answers {want}"), timeout, || async {
        match member.http_get("/readyz").await {
            (status, body) if status == want => Ok(body),
            (status, body) => Err(format!("{status} {body}")),
        }
    })
    .await
}
