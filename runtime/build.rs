//! Stamps the binary with the git commit it was built from, so `gpulane --version`, the
//! container images' labels and a bug report all name the same source.
//!
//! `GPULANE_GIT_COMMIT` wins (a build from a source tarball, or a packager that knows the
//! commit); else `git rev-parse` in the source tree; else `unknown`.

use std::{path::Path, process::Command};

fn main() {
    println!("cargo:rerun-if-env-changed=GPULANE_GIT_COMMIT");
    let commit = std::env::var("GPULANE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_owned());
    let features = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        "cuda"
    } else {
        "cpu"
    };
    println!(
        "cargo:rustc-env=GPULANE_LONG_VERSION={} (commit {commit}, {features})",
        std::env::var("CARGO_PKG_VERSION").unwrap_or_default()
    );
}

/// The commit of the checkout, and rebuild triggers on the files that move with it.
fn git_commit() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "--git-dir", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = String::from_utf8(out.stdout).ok()?;
    let mut lines = text.lines();
    let git_dir = Path::new(lines.next()?).to_path_buf();
    let commit = lines.next()?.get(..12)?.to_owned();
    // HEAD moves when a branch is switched; the branch's ref (or packed-refs) when a
    // commit lands on it.
    // A watched path that does not exist would rerun this script on every build.
    let mut watch = vec![git_dir.join("HEAD"), git_dir.join("packed-refs")];
    if let Ok(head) = std::fs::read_to_string(git_dir.join("HEAD")) {
        if let Some(reference) = head.trim().strip_prefix("ref: ") {
            let loose = git_dir.join(reference);
            // A checkout whose refs are all packed has no file for the branch until its
            // next commit writes one, and that commit touches neither HEAD nor
            // packed-refs: watch the folder the file will appear in (Cargo scans a
            // watched folder for changes), or the binary keeps naming the old commit.
            if !loose.exists() {
                if let Some(folder) = loose.parent() {
                    watch.push(folder.to_path_buf());
                }
            }
            watch.push(loose);
        }
    }
    for path in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    Some(commit)
}
