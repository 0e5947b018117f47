use std::path::PathBuf;

use crate::devices::DeviceError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why the daemon could not start or had to stop. None of these is retried inside the
/// process: the worker exits non-zero and says why, and a supervisor restarts it.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A flag or variable is wrong; the message names it and the fix.
    #[error("configuration: {0}")]
    Config(String),
    /// Another process already polls one of this worker's private queues (the same
    /// `--host`, serving the same card): pinning would silently break. Not retryable.
    #[error(
        "task queue {queue} is already polled by {other} (seen {seconds_ago:.0} s ago): another \
         gpulane serves this card under the same host name; give each worker its own --host \
         (GPULANE_HOST), or stop the other one"
    )]
    QueueTaken {
        /// The private queue.
        queue: String,
        /// The other poller's identity.
        other: String,
        /// When the server last saw it poll.
        seconds_ago: f64,
    },
    /// A file named by a flag could not be read.
    #[error("reading {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file named by a flag could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The device inventory failed.
    #[error("devices: {0}")]
    Device(#[from] DeviceError),
    /// A declared model could not load on a device.
    #[error("model {name:?} on {device}: {source}")]
    Model {
        /// The model's name.
        name: String,
        /// The device label.
        device: String,
        /// Why.
        #[source]
        source: Box<gpulane_models::ModelError>,
    },
    /// The Temporal frontend could not be reached.
    #[error(
        "connecting to Temporal at {address}: {reason} (check --address / TEMPORAL_ADDRESS \
         and that the server is up)"
    )]
    Connect {
        /// The address dialled.
        address: String,
        /// The innermost cause (refused, no such host, TLS): the layers above it repeat
        /// one another, so the whole chain goes to the debug log instead.
        reason: String,
    },
    /// sdk-core refused to create or validate a lane's worker.
    #[error("starting the worker for task queue {queue}: {source}")]
    Worker {
        /// The lane's queue.
        queue: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// A lane's poller failed for good (core has shut that worker down).
    #[error("polling task queue {queue}: {source}")]
    Poll {
        /// The lane's queue.
        queue: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// The worker stopped because something failed (a lane, an engine thread or a
    /// background task died), or its stop outlived the deadline; the process exits
    /// non-zero so that its supervisor restarts it.
    #[error("stopped: {0}")]
    Stopped(String),
    /// `gpulane kernel-check` found kernels outside their bounds on a device.
    #[error("{failed} of {total} kernel checks on {device} are out of bounds (see the table)")]
    KernelCheck {
        /// The device checked.
        device: String,
        /// Checks out of bounds.
        failed: usize,
        /// Checks run.
        total: usize,
    },
    /// A running worker's admin API refused a request or could not be reached.
    #[error("admin API at {address}: {message}")]
    Admin {
        /// The address dialled.
        address: String,
        /// What it said.
        message: String,
    },
}
