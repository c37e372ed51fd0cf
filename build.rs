//! Build-time facts for the `clickagg_build_info` metric: the rustc version, and the git
//! commit where it is cheap to know.
//!
//! The commit comes from `CLICKAGG_GIT_SHA` when the builder sets it (a Docker build has
//! no `.git`: `docker build --build-arg CLICKAGG_GIT_SHA=$(git rev-parse HEAD)`), or, in
//! release builds from a git checkout, from `git rev-parse HEAD`. Debug builds leave it
//! out: knowing it would rebuild the crate after every commit. Without either, the
//! metric carries the version alone.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CLICKAGG_GIT_SHA");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    // "rustc 1.89.0 (29483883e 2025-08-04)"
    let version = output(Command::new(rustc).arg("--version"));
    if let Some(v) = version.as_deref().and_then(|v| v.split_whitespace().nth(1)) {
        println!("cargo:rustc-env=CLICKAGG_BUILD_RUSTC={v}");
    }
    let sha = match std::env::var("CLICKAGG_GIT_SHA") {
        Ok(sha) => Some(sha.trim().to_string()),
        Err(_) if std::env::var("PROFILE").as_deref() == Ok("release") => git_head(),
        Err(_) => None,
    };
    if let Some(sha) = sha.filter(|s| (7..=40).contains(&s.len()) && s.chars().all(|c| c.is_ascii_hexdigit())) {
        println!("cargo:rustc-env=CLICKAGG_BUILD_GIT_SHA={sha}");
    }
}

/// `git rev-parse HEAD` of the checkout, and the files whose change moves it (HEAD, the
/// branch's ref, packed refs) as rerun triggers; `None` outside a git checkout.
fn git_head() -> Option<String> {
    let dir = std::env::var("CARGO_MANIFEST_DIR").ok()?;
    let git = |args: &[&str]| output(Command::new("git").arg("-C").arg(&dir).args(args));
    let sha = git(&["rev-parse", "HEAD"])?;
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    for name in ["HEAD", "packed-refs"].into_iter().chain(branch.as_deref()) {
        if let Some(path) = git(&["rev-parse", "--path-format=absolute", "--git-path", name]) {
            if Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    Some(sha)
}

fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok().filter(|o| o.status.success())?;
    String::from_utf8(out.stdout).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}
