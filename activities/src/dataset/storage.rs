//! Where `embed_dataset` may read and write: the worker's `--data-root` URIs, and the
//! object stores behind them (`file://` through the local filesystem, `s3://` through
//! S3-compatible storage configured by the standard AWS environment variables, never by
//! the payload). A URI outside every root is refused, and so are `..` segments and, on the
//! filesystem, symlinks that lead out of a root.

use std::{
    path::{Component, PathBuf},
    sync::Arc,
};

use object_store::{aws::AmazonS3Builder, local::LocalFileSystem, path::Path, ObjectStore};

use crate::{input::quote_uri, ActivityError};

/// One `--data-root`.
#[derive(Clone)]
enum Root {
    /// A directory, canonical (symlinks resolved) at start.
    File(PathBuf),
    /// A bucket and a key prefix (empty, or ending in `/`), with its client, built once at
    /// start from the environment.
    S3 {
        bucket: String,
        prefix: String,
        store: Arc<dyn ObjectStore>,
    },
}

/// The roots a worker may read and write under, parsed once at start.
#[derive(Clone, Default)]
pub struct DataRoots {
    roots: Vec<(String, Root)>,
    local: Option<Arc<dyn ObjectStore>>,
}

impl std::fmt::Debug for DataRoots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.roots.iter().map(|(u, _)| u))
            .finish()
    }
}

/// A resolved URI: the store that holds it and the object's path there.
#[derive(Clone)]
pub(crate) struct Location {
    pub store: Arc<dyn ObjectStore>,
    pub path: Path,
}

/// Whether a location is read (must exist, symlinks resolved) or written (may not exist
/// yet: its deepest existing folder is checked).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

fn has_dotdot(s: &str) -> bool {
    s.split('/').any(|seg| seg == "..")
}

impl DataRoots {
    /// Parses `--data-root` URIs: `file:///abs/dir` (the directory must exist) or
    /// `s3://bucket[/prefix]`.
    pub fn parse(uris: &[String]) -> Result<Self, String> {
        let mut roots = Vec::with_capacity(uris.len());
        for uri in uris {
            let root = if let Some(p) = uri.strip_prefix("file://") {
                let dir = PathBuf::from(p);
                if !dir.is_absolute() || has_dotdot(p) {
                    return Err(format!(
                        "--data-root {uri:?}: a file:// root is an absolute path without '..'"
                    ));
                }
                let canonical = dir
                    .canonicalize()
                    .map_err(|e| format!("--data-root {uri:?}: {e}; create the directory first"))?;
                if !canonical.is_dir() {
                    return Err(format!("--data-root {uri:?} is not a directory"));
                }
                Root::File(canonical)
            } else if let Some(rest) = uri.strip_prefix("s3://") {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() || has_dotdot(prefix) {
                    return Err(format!(
                        "--data-root {uri:?}: write s3://bucket or s3://bucket/prefix/"
                    ));
                }
                let mut prefix = prefix.trim_start_matches('/').to_owned();
                if !prefix.is_empty() && !prefix.ends_with('/') {
                    prefix.push('/');
                }
                Root::S3 {
                    bucket: bucket.to_owned(),
                    prefix,
                    store: s3_store(bucket).map_err(|e| format!("--data-root {uri:?}: {e}"))?,
                }
            } else {
                return Err(format!(
                    "--data-root {uri:?}: use file:///absolute/dir or s3://bucket/prefix"
                ));
            };
            roots.push((uri.clone(), root));
        }
        let local = roots
            .iter()
            .any(|(_, r)| matches!(r, Root::File(_)))
            .then(|| Arc::new(LocalFileSystem::new()) as Arc<dyn ObjectStore>);
        Ok(Self { roots, local })
    }

    /// Whether any root is configured.
    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    fn refused(&self, field: &str, uri: &str, why: &str) -> ActivityError {
        ActivityError::InvalidInput(format!(
            "field \"{field}\" is {}: {why}; this worker reads and writes only under its data roots {:?} (--data-root): use a URI under one of them, or add a root on the worker",
            quote_uri(uri),
            self.roots.iter().map(|(u, _)| u).collect::<Vec<_>>()
        ))
    }

    /// Resolves `uri` (the request's `field`) to a location inside a root, or refuses it.
    pub(crate) fn resolve(
        &self,
        field: &str,
        uri: &str,
        access: Access,
    ) -> Result<Location, ActivityError> {
        if self.roots.is_empty() {
            return Err(ActivityError::InvalidInput(
                "embed_dataset needs storage, and this worker has no data roots: start it with --data-root file:///dir or --data-root s3://bucket/prefix".to_owned(),
            ));
        }
        if let Some(p) = uri.strip_prefix("file://") {
            return self.resolve_file(field, uri, p, access);
        }
        if let Some(rest) = uri.strip_prefix("s3://") {
            let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
            if has_dotdot(key) {
                return Err(self.refused(field, uri, "'..' is not allowed in a URI"));
            }
            let store = self.roots.iter().find_map(|(_, r)| match r {
                Root::S3 {
                    bucket: b,
                    prefix,
                    store,
                } if b == bucket && key.starts_with(prefix.as_str()) => Some(store.clone()),
                _ => None,
            });
            let Some(store) = store else {
                return Err(self.refused(field, uri, "it is outside the data roots"));
            };
            return Ok(Location {
                store,
                path: Path::from(key),
            });
        }
        Err(self.refused(field, uri, "only file:// and s3:// URIs are read"))
    }

    fn resolve_file(
        &self,
        field: &str,
        uri: &str,
        p: &str,
        access: Access,
    ) -> Result<Location, ActivityError> {
        let path = PathBuf::from(p);
        if !path.is_absolute() {
            return Err(self.refused(field, uri, "a file:// URI is an absolute path"));
        }
        if path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(self.refused(field, uri, "'..' is not allowed in a URI"));
        }
        // Resolve symlinks: of the file itself when reading, of its deepest existing
        // folder when writing (the rest does not exist yet, so holds no link).
        let resolved = match access {
            Access::Read => path.canonicalize().map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound && self.under_root(&path) {
                    ActivityError::InvalidInput(format!(
                        "field \"{field}\": {} does not exist; check the URI",
                        quote_uri(uri)
                    ))
                } else {
                    self.refused(field, uri, "it cannot be resolved inside a data root")
                }
            })?,
            Access::Write => {
                let mut existing = path.as_path();
                let mut rest = Vec::new();
                while !existing.exists() {
                    rest.push(existing.file_name().map(|f| f.to_owned()));
                    existing = match existing.parent() {
                        Some(p) => p,
                        None => break,
                    };
                }
                let mut out = existing
                    .canonicalize()
                    .map_err(|_| self.refused(field, uri, "it cannot be resolved"))?;
                for part in rest.into_iter().rev().flatten() {
                    out.push(part);
                }
                out
            }
        };
        if !self.under_root(&resolved) {
            return Err(self.refused(
                field,
                uri,
                "it is outside the data roots (after following symlinks)",
            ));
        }
        // A file where the output folder would be makes every write fail, and the store
        // reports that as a generic error, which would be retried forever. Checked inside
        // the roots only, so the answer says nothing about files outside them.
        if access == Access::Write {
            if let Some(file) = resolved.ancestors().find(|a| a.is_file()) {
                return Err(ActivityError::InvalidInput(format!(
                    "field \"{field}\" is {}: {} is a file, not a folder; name a folder to write under",
                    quote_uri(uri),
                    quote_uri(&file.display().to_string())
                )));
            }
        }
        let store = self
            .local
            .clone()
            .expect("a file root exists when a path is under one; this is a bug");
        let path = Path::from_absolute_path(&resolved)
            .map_err(|e| self.refused(field, uri, &format!("not a valid path ({e})")))?;
        Ok(Location { store, path })
    }

    fn under_root(&self, p: &std::path::Path) -> bool {
        self.roots.iter().any(|(_, r)| match r {
            Root::File(dir) => p.starts_with(dir),
            Root::S3 { .. } => false,
        })
    }
}

/// The S3 client for `bucket`, configured from the environment (AWS_ENDPOINT_URL,
/// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP, …), the way AWS
/// tools are; credentials never come from a payload.
fn s3_store(bucket: &str) -> Result<Arc<dyn ObjectStore>, ActivityError> {
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Ok(e) = std::env::var("AWS_ENDPOINT_URL").or_else(|_| std::env::var("AWS_ENDPOINT")) {
        b = b.with_endpoint(e);
    }
    if std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        b = b.with_allow_http(true);
    }
    if std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err() {
        b = b.with_region("us-east-1");
    }
    b.build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| {
            ActivityError::StorageUnavailable(format!("configuring S3 for bucket {bucket:?}: {e}"))
        })
}

/// A storage error as an activity failure: a missing object is the request's fault
/// (non-retryable, naming the URI); anything else may pass (retryable).
pub(crate) fn storage_error(uri: &str, e: object_store::Error) -> ActivityError {
    match e {
        object_store::Error::NotFound { .. } => {
            ActivityError::InvalidInput(format!("{} does not exist; check the URI", quote_uri(uri)))
        }
        // The object is not the version the read began on: it was replaced part-way.
        object_store::Error::Precondition { .. } => {
            changed(uri, "storage no longer holds the version first read")
        }
        other => ActivityError::StorageUnavailable(format!("{}: {other}", quote_uri(uri))),
    }
}

/// A source replaced while a job read it. That is storage's doing, not the payload's, so
/// it is retryable: the retry reads the new file from its start.
pub(crate) fn changed(uri: &str, why: &str) -> ActivityError {
    ActivityError::StorageUnavailable(format!(
        "{} changed while it was read ({why}); a retry reads it anew",
        quote_uri(uri)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roots(dir: &std::path::Path) -> DataRoots {
        DataRoots::parse(&[
            format!("file://{}/", dir.display()),
            "s3://bucket/data/".to_owned(),
        ])
        .unwrap()
    }

    fn refused(r: &DataRoots, uri: &str, access: Access) -> String {
        match r.resolve("source", uri, access) {
            Ok(_) => panic!("{uri} was allowed"),
            Err(e) => {
                assert!(!e.is_retryable());
                e.to_string()
            }
        }
    }

    #[test]
    fn an_output_under_a_file_is_refused_for_good() {
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        std::fs::write(dir.path().join("corpus.parquet"), b"rows").unwrap();
        for out in ["corpus.parquet/", "corpus.parquet/sub/"] {
            let uri = format!("file://{}/{out}", dir.path().display());
            let m = refused(&r, &uri, Access::Write);
            assert!(
                m.contains("corpus.parquet\" is a file, not a folder"),
                "{m}"
            );
        }
        let uri = format!("file://{}/new/sub/", dir.path().display());
        assert!(r.resolve("output", &uri, Access::Write).is_ok());
        // Outside the roots a file is not told apart from a folder.
        let m = refused(&r, "file:///etc/passwd/", Access::Write);
        assert!(m.contains("outside the data roots"), "{m}");
    }

    #[test]
    fn uris_outside_the_roots_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = roots(dir.path());
        let m = refused(&r, "file:///etc/passwd", Access::Read);
        assert!(m.contains("/etc/passwd") && m.contains("outside"), "{m}");
        let m = refused(
            &r,
            &format!("file://{}/../x", dir.path().display()),
            Access::Read,
        );
        assert!(m.contains(".."), "{m}");
        assert!(refused(&r, "s3://bucket/other/x.parquet", Access::Read).contains("outside"));
        assert!(refused(&r, "s3://elsewhere/data/x", Access::Read).contains("outside"));
        assert!(refused(&r, "s3://bucket/data/../x", Access::Read).contains(".."));
        assert!(refused(&r, "http://x/y", Access::Read).contains("file://"));
    }

    #[test]
    fn a_symlink_out_of_a_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "x").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).unwrap();
        let r = roots(dir.path());
        let m = refused(
            &r,
            &format!("file://{}/link", dir.path().display()),
            Access::Read,
        );
        assert!(m.contains("symlinks"), "{m}");
        let m = refused(
            &r,
            &format!("file://{}/out/new/", dir.path().display()),
            Access::Write,
        );
        assert!(m.contains("symlinks"), "{m}");
    }

    #[test]
    fn paths_inside_resolve_and_missing_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.jsonl"), "{}").unwrap();
        let r = roots(dir.path());
        let uri = format!("file://{}/a.jsonl", dir.path().display());
        assert!(r.resolve("source", &uri, Access::Read).is_ok());
        let out = format!("file://{}/out/run1/", dir.path().display());
        assert!(r.resolve("output", &out, Access::Write).is_ok());
        let missing = format!("file://{}/nope.parquet", dir.path().display());
        let m = refused(&r, &missing, Access::Read);
        assert!(
            m.contains("nope.parquet") && m.contains("does not exist"),
            "{m}"
        );
        assert!(r
            .resolve("source", "s3://bucket/data/x.parquet", Access::Read)
            .is_ok());
    }

    #[test]
    fn without_roots_the_activity_says_how_to_add_one() {
        let e = DataRoots::default()
            .resolve("source", "file:///x", Access::Read)
            .err()
            .unwrap();
        assert!(e.to_string().contains("--data-root"));
    }
}
