//! Stamps the binary with the git commit it was built from, so `gpulane --version`, the
//! container images' labels and a bug report all name the same source.
//!
//! `GPULANE_GIT_COMMIT` wins (a build from a source tarball, or a packager that knows the
//! commit); else `git rev-parse` in the source tree; else `unknown`.

use std::process::Command;

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
        .args(["rev-parse", "--git-dir", "--git-common-dir", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = String::from_utf8(out.stdout).ok()?;
    let mut lines = text.lines();
    // A linked worktree has its own HEAD (the git dir) but shares refs and packed-refs
    // with the main checkout (the common dir); a plain checkout has one folder for both.
    // Both may come back relative to this script's folder (the package's); made absolute
    // so the watched paths do not depend on where Cargo resolves them.
    let here = std::env::current_dir().ok()?;
    let git_dir = here.join(lines.next()?);
    let common = here.join(lines.next()?);
    let commit = lines.next()?.get(..12)?.to_owned();
    // HEAD moves when a branch is switched; the branch's ref (or packed-refs) when a
    // commit lands on it.
    // A watched path that does not exist would rerun this script on every build.
    let mut watch = vec![git_dir.join("HEAD"), common.join("packed-refs")];
    if let Ok(head) = std::fs::read_to_string(git_dir.join("HEAD")) {
        if let Some(reference) = head.trim().strip_prefix("ref: ") {
            let loose = common.join(reference);
            // A checkout whose refs are all packed has no file for the branch until its
            // next commit writes one, and that commit touches neither HEAD nor
            // packed-refs: watch the nearest folder that exists on the way to it (Cargo
            // scans a watched folder for changes; a branch `a/b` may lack `refs/heads/a`
            // too), or the binary keeps naming the old commit.
            if loose.exists() {
                watch.push(loose);
            } else if let Some(folder) = loose.ancestors().skip(1).find(|p| p.is_dir()) {
                watch.push(folder.to_path_buf());
            }
        }
    }
    for path in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    Some(commit)
}
