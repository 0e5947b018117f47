//! The thin edge between gpulane and Temporal's official crates: the client connection,
//! payload encoding, and activity errors turned into typed application failures.

use std::time::Duration;

use gpulane_activities::ActivityError;
use temporalio_client::{ClientTlsOptions, Connection, ConnectionOptions, TlsOptions};
use temporalio_common::protos::{
    temporal::api::{
        common::v1::Payload,
        enums::v1::{TaskQueueKind, TaskQueueType},
        failure::v1::{failure::FailureInfo, ApplicationFailureInfo, Failure},
        taskqueue::v1::TaskQueue,
        workflowservice::v1::{
            DescribeTaskQueueRequest, DescribeTaskQueueResponse, GetSystemInfoRequest,
        },
    },
    ENCODING_PAYLOAD_KEY, JSON_ENCODING_VAL,
};

use crate::{settings::TemporalSettings, RuntimeError};

fn read_pem(path: &std::path::Path) -> Result<Vec<u8>, RuntimeError> {
    std::fs::read(path).map_err(|source| RuntimeError::File {
        path: path.to_owned(),
        source,
    })
}

/// Connects to the Temporal frontend the settings name, with TLS when they ask for it
/// (the client crate does not turn it on by itself for an API key).
pub(crate) async fn connect(
    settings: &TemporalSettings,
    identity: &str,
) -> Result<Connection, RuntimeError> {
    let tls_options = match &settings.tls {
        Some(tls) => {
            let client = match &tls.client {
                Some((cert, key)) => Some(
                    ClientTlsOptions::builder()
                        .client_cert(read_pem(cert)?)
                        .client_private_key(read_pem(key)?)
                        .build(),
                ),
                None => None,
            };
            let ca = tls.server_ca.as_deref().map(read_pem).transpose()?;
            Some(
                TlsOptions::builder()
                    .maybe_server_root_ca_cert(ca)
                    .maybe_client_tls_options(client)
                    .maybe_domain(tls.server_name.clone())
                    .build(),
            )
        }
        None => None,
    };
    let opts = ConnectionOptions::new(settings.url.clone())
        .identity(identity.to_owned())
        .maybe_api_key(settings.api_key.as_ref().map(|k| k.expose().to_owned()))
        .maybe_tls_options(tls_options)
        .connect_timeout(Duration::from_secs(10))
        .build();
    Connection::connect(opts).await.map_err(|source| {
        tracing::debug!(error = ?source, "connecting to Temporal failed");
        RuntimeError::Connect {
            address: settings.address.clone(),
            reason: root_cause(&source),
        }
    })
}

/// The last error of a `source()` chain, as text.
fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// One lane's queue as the server sees it: `DescribeTaskQueue` with stats, for the
/// activity task type (backlog count and age, add and dispatch rates, pollers).
pub(crate) async fn describe_activity_queue(
    connection: &Connection,
    namespace: &str,
    queue: &str,
) -> Result<DescribeTaskQueueResponse, tonic::Status> {
    let request = DescribeTaskQueueRequest {
        namespace: namespace.to_owned(),
        task_queue: Some(TaskQueue {
            name: queue.to_owned(),
            kind: TaskQueueKind::Normal as i32,
            ..Default::default()
        }),
        task_queue_type: TaskQueueType::Activity as i32,
        report_stats: true,
        report_config: true,
        ..Default::default()
    };
    let mut service = connection.workflow_service();
    service
        .describe_task_queue(tonic::Request::new(request))
        .await
        .map(tonic::Response::into_inner)
}

/// Another process's poller of a queue, as the server lists it.
#[derive(Debug, Clone)]
pub(crate) struct OtherPoller {
    pub identity: String,
    /// When the server last saw it poll.
    pub last_access: std::time::SystemTime,
    /// Whether it runs: known for a default identity of this host (`gpulane@<host>:<pid>`,
    /// by its PID), unknown otherwise (a pod's name, a custom `--identity`).
    pub alive: Option<bool>,
}

/// Pollers of `queue` that are not this process (their identity is not `ours`, nor
/// `ours/...`), seen within the last [`OTHER_RECENT`], leaving out a dead predecessor on
/// this host (a worker restarted after a crash).
pub(crate) async fn other_pollers(
    connection: &Connection,
    namespace: &str,
    queue: &str,
    ours: &str,
) -> Result<Vec<OtherPoller>, tonic::Status> {
    let r = describe_activity_queue(connection, namespace, queue).await?;
    let now = std::time::SystemTime::now();
    Ok(r.pollers
        .into_iter()
        .filter_map(|p| {
            let last_access = p
                .last_access_time
                .and_then(|t| std::time::SystemTime::try_from(t).ok())
                .unwrap_or(now);
            let mine = is_ours(&p.identity, ours);
            let recent = now.duration_since(last_access).unwrap_or_default() < OTHER_RECENT;
            let alive = pid_alive(&p.identity, ours);
            (!mine && recent && alive != Some(false)).then_some(OtherPoller {
                identity: p.identity,
                last_access,
                alive,
            })
        })
        .collect())
}

/// How recently another poller must have polled to count: a live one polls again at the
/// latest when its long poll (about a minute) ends.
pub(crate) const OTHER_RECENT: std::time::Duration = std::time::Duration::from_secs(90);

/// Whether a poller's `identity` is one of this process's lanes (`ours/<device>/<queue>`).
/// A custom `--identity` may itself contain '/'.
fn is_ours(identity: &str, ours: &str) -> bool {
    identity
        .strip_prefix(ours)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Whether the process behind a default identity of this host (`gpulane@<host>:<pid>/...`,
/// as `ours` is) still runs; `None` for any other identity.
fn pid_alive(identity: &str, ours: &str) -> Option<bool> {
    let (our_host, _) = ours.rsplit_once(':')?;
    let (host, pid) = identity.split('/').next()?.rsplit_once(':')?;
    let pid: u32 = pid.parse().ok()?;
    (host == our_host).then(|| std::path::Path::new(&format!("/proc/{pid}")).exists())
}

/// Whether the frontend answers now (a cheap `GetSystemInfo`), for readiness.
pub(crate) async fn reachable(connection: &Connection) -> Result<(), tonic::Status> {
    let mut service = connection.workflow_service();
    service
        .get_system_info(tonic::Request::new(GetSystemInfoRequest::default()))
        .await
        .map(drop)
}

/// A `json/plain` payload, what every SDK's default data converter reads.
pub(crate) fn json_payload(data: Vec<u8>) -> Payload {
    let mut p = Payload {
        data,
        ..Default::default()
    };
    p.metadata.insert(
        ENCODING_PAYLOAD_KEY.to_owned(),
        JSON_ENCODING_VAL.as_bytes().to_vec(),
    );
    p
}

/// The JSON bytes of an activity's first argument, or an input error that says what to
/// send instead.
pub(crate) fn input_json(input: &[Payload]) -> Result<&[u8], ActivityError> {
    let p = match input {
        [p] => p,
        [] => {
            return Err(ActivityError::InvalidInput(
                "no input: pass one argument, a JSON object like {\"texts\": [\"...\"]}".to_owned(),
            ))
        }
        more => {
            return Err(ActivityError::InvalidInput(format!(
                "{} arguments given: every gpulane activity takes exactly one, a JSON object \
                 like {{\"texts\": [\"...\"]}}; put the options in that object",
                more.len()
            )))
        }
    };
    let encoding = p
        .metadata
        .get(ENCODING_PAYLOAD_KEY)
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .unwrap_or_default();
    if encoding == JSON_ENCODING_VAL {
        Ok(&p.data)
    } else if encoding == "binary/null" {
        Err(ActivityError::InvalidInput(
            "input is null: pass a JSON object like {\"texts\": [\"...\"]}".to_owned(),
        ))
    } else {
        Err(ActivityError::InvalidInput(format!(
            "input payload is encoded as {encoding:?}; gpulane takes json/plain, the default of every SDK's data converter"
        )))
    }
}

/// An application failure a workflow can match on by type, retryable as the error says,
/// with the error's own delay before the next attempt where it has one (`attempt` is the
/// attempt that failed, from 1).
pub(crate) fn failure(err: &ActivityError, attempt: u32) -> Failure {
    Failure {
        message: err.to_string(),
        source: "gpulane".to_owned(),
        failure_info: Some(FailureInfo::ApplicationFailureInfo(
            ApplicationFailureInfo {
                r#type: err.failure_type().to_owned(),
                non_retryable: !err.is_retryable(),
                next_retry_delay: err.retry_delay(attempt).and_then(|d| d.try_into().ok()),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_argument_is_refused() {
        let p = json_payload(b"{}".to_vec());
        let e = input_json(&[p.clone(), p]).unwrap_err().to_string();
        assert!(
            e.contains("2 arguments") && e.contains("exactly one"),
            "{e}"
        );
    }

    #[test]
    fn other_pollers_are_told_from_this_process_and_from_dead_predecessors() {
        let me = format!("gpulane@box:{}", std::process::id());
        assert!(is_ours(&format!("{me}/GPU-1/q"), &me));
        assert!(
            !is_ours(&format!("{me}0/GPU-1/q"), &me),
            "another PID with our digits"
        );
        assert!(
            is_ours("team/a/GPU-1/q", "team/a"),
            "a custom identity with '/'"
        );
        // This process runs; PID 0 never names a process in /proc.
        assert_eq!(pid_alive(&format!("{me}/GPU-1/q"), &me), Some(true));
        assert_eq!(pid_alive("gpulane@box:0/GPU-1/q", &me), Some(false));
        assert_eq!(
            pid_alive("gpulane@other:1/GPU-1/q", &me),
            None,
            "another host"
        );
        assert_eq!(
            pid_alive("gpulane@pod-7f9c/GPU-1/q", &me),
            None,
            "a pod's name"
        );
    }

    #[test]
    fn input_must_be_json() {
        assert!(input_json(&[]).is_err());
        let mut p = json_payload(b"{}".to_vec());
        assert_eq!(input_json(std::slice::from_ref(&p)).unwrap(), b"{}");
        p.metadata
            .insert(ENCODING_PAYLOAD_KEY.to_owned(), b"binary/plain".to_vec());
        let e = input_json(&[p]).unwrap_err().to_string();
        assert!(
            e.contains("binary/plain") && e.contains("json/plain"),
            "{e}"
        );
    }

    #[test]
    fn failures_carry_type_and_retryability() {
        let f = failure(
            &ActivityError::InvalidInput("field \"texts\" is empty".into()),
            1,
        );
        let Some(FailureInfo::ApplicationFailureInfo(info)) = f.failure_info else {
            panic!("not an application failure")
        };
        assert_eq!(info.r#type, "InvalidInput");
        assert!(info.non_retryable);
        assert!(f.message.contains("texts"));
        let f = failure(
            &ActivityError::Model(gpulane_models::ModelError::EngineStopped),
            1,
        );
        let Some(FailureInfo::ApplicationFailureInfo(info)) = f.failure_info else {
            panic!("not an application failure")
        };
        assert!(!info.non_retryable);
        assert_eq!(info.next_retry_delay, None);
    }

    #[test]
    fn a_model_not_served_here_is_retried_later_and_later() {
        let e = ActivityError::ModelNotServed {
            name: "\"e5\"".into(),
            known: vec!["minilm".into()],
            queue: "gpu-tools".into(),
            model_queue: "gpu-tools@e5".into(),
        };
        let delay = |attempt| {
            let Some(FailureInfo::ApplicationFailureInfo(info)) = failure(&e, attempt).failure_info
            else {
                panic!("not an application failure")
            };
            assert!(!info.non_retryable);
            assert_eq!(info.r#type, "ModelNotServed");
            let d = info.next_retry_delay.unwrap();
            d.seconds as f64 + f64::from(d.nanos) * 1e-9
        };
        // About a second per attempt, at most about a minute, jittered by ±50%.
        for (attempt, base) in [(1, 1.0), (5, 5.0), (500, 60.0)] {
            let d = delay(attempt);
            assert!(d >= base * 0.5 && d < base * 1.5, "attempt {attempt}: {d}");
        }
        let spread: Vec<f64> = (0..20).map(|_| delay(10)).collect();
        assert!(
            spread.iter().any(|d| (d - spread[0]).abs() > 1e-3),
            "no jitter: {spread:?}"
        );
    }

    #[test]
    fn root_cause_is_the_innermost_error() {
        #[derive(Debug, thiserror::Error)]
        #[error("transport error: {0}")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        ));
        assert_eq!(root_cause(&e), "Connection refused (os error 111)");
    }
}
