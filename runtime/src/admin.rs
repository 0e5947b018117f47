//! The admin API (`proto/admin.proto`): served over tonic on `--admin-address`, and its
//! command-line clients `gpulane status | drain | resume`.
//!
//! The admin API and the probes run on a runtime of their own, on their own thread, so
//! they stay answerable however busy the data plane is (linkerd's admin server does the
//! same); the thread's end, by error or panic, is a failure the supervisor acts on.

use std::{net::TcpListener as StdListener, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use gpulane_proto::admin::{
    admin_client::AdminClient,
    admin_server::{Admin, AdminServer},
    Backlog, DrainRequest, DrainResponse, Poller, ResumeRequest, ResumeResponse, StatusRequest,
    StatusResponse,
};
use temporalio_client::Connection;
use temporalio_common::protos::temporal::api::enums::v1::RateLimitSource;
use tonic::{Request, Response, Status};

use crate::{
    config::{AdminArgs, DeviceTarget, StatusArgs},
    health::Health,
    metrics::Metrics,
    supervisor::{AdminError, SupervisorHandle},
    temporal, RuntimeError,
};

/// How long one lane's `DescribeTaskQueue` may take in `Status`.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(5);

struct Service {
    supervisor: SupervisorHandle,
    connection: Connection,
    namespace: String,
}

fn gone() -> Status {
    Status::unavailable("the worker is stopping")
}

fn refused(e: AdminError) -> Status {
    match e {
        AdminError::NotFound(m) => Status::not_found(m),
        AdminError::Refused(m) => Status::failed_precondition(m),
    }
}

/// The lane's backlog as the server reports it, or why it could not be read.
async fn backlog(connection: &Connection, namespace: &str, queue: &str) -> Backlog {
    let described = tokio::time::timeout(
        DESCRIBE_TIMEOUT,
        temporal::describe_activity_queue(connection, namespace, queue),
    )
    .await;
    let r = match described {
        Err(_) => {
            return Backlog {
                error: format!(
                    "DescribeTaskQueue took over {} s",
                    DESCRIBE_TIMEOUT.as_secs()
                ),
                ..Backlog::default()
            }
        }
        Ok(Err(e)) => {
            return Backlog {
                error: format!("DescribeTaskQueue: {}", e.message()),
                ..Backlog::default()
            }
        }
        Ok(Ok(r)) => r,
    };
    let stats = r.stats.unwrap_or_default();
    let now = std::time::SystemTime::now();
    let (rate_limit_per_second, rate_limit_source) =
        r.effective_rate_limit.map_or((0.0, String::new()), |l| {
            let source = match l.rate_limit_source() {
                RateLimitSource::Api => "api",
                RateLimitSource::Worker => "worker",
                RateLimitSource::System => "system",
                RateLimitSource::Unspecified => "",
            };
            (l.requests_per_second, source.to_owned())
        });
    Backlog {
        error: String::new(),
        rate_limit_per_second,
        rate_limit_source,
        approximate_backlog_count: stats.approximate_backlog_count,
        approximate_backlog_age_seconds: stats
            .approximate_backlog_age
            .map_or(0.0, |d| d.seconds as f64 + f64::from(d.nanos) * 1e-9),
        tasks_add_rate: stats.tasks_add_rate,
        tasks_dispatch_rate: stats.tasks_dispatch_rate,
        pollers: r
            .pollers
            .into_iter()
            .map(|p| Poller {
                last_access_seconds_ago: p
                    .last_access_time
                    .and_then(|t| std::time::SystemTime::try_from(t).ok())
                    .and_then(|t| now.duration_since(t).ok())
                    .map_or(0.0, |d| d.as_secs_f64()),
                identity: p.identity,
                rate_per_second: p.rate_per_second,
                deployment_name: p
                    .deployment_options
                    .as_ref()
                    .map(|d| d.deployment_name.clone())
                    .unwrap_or_default(),
                build_id: p.deployment_options.map(|d| d.build_id).unwrap_or_default(),
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl Admin for Service {
    async fn status(
        &self,
        request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let mut status = self.supervisor.status().await.ok_or_else(gone)?;
        if !request.get_ref().skip_backlog {
            let backlogs = futures::future::join_all(
                status
                    .lanes
                    .iter()
                    .map(|l| backlog(&self.connection, &self.namespace, &l.task_queue)),
            )
            .await;
            for (lane, b) in status.lanes.iter_mut().zip(backlogs) {
                lane.backlog = Some(b);
            }
        }
        Ok(Response::new(status))
    }

    async fn drain(
        &self,
        request: Request<DrainRequest>,
    ) -> Result<Response<DrainResponse>, Status> {
        let device = request.into_inner().device;
        tracing::info!(%device, "admin: drain");
        answer(self.supervisor.drain(device).await)
    }

    async fn resume(
        &self,
        request: Request<ResumeRequest>,
    ) -> Result<Response<ResumeResponse>, Status> {
        let device = request.into_inner().device;
        tracing::info!(%device, "admin: resume");
        answer(self.supervisor.resume(device).await)
    }
}

/// The supervisor's answer as a gRPC response: gone while it stops, refusals by kind.
fn answer<R>(reply: Option<Result<R, AdminError>>) -> Result<Response<R>, Status> {
    reply.ok_or_else(gone)?.map(Response::new).map_err(refused)
}

/// What the admin thread serves: `/metrics` and the probes on `http`, the admin API on
/// `admin` (either may be off).
pub(crate) struct AdminThread {
    pub http: Option<StdListener>,
    pub admin: Option<StdListener>,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    pub supervisor: SupervisorHandle,
    pub connection: Connection,
    pub namespace: String,
}

/// Starts the admin thread. Its end is reported to the supervisor as a failure.
pub(crate) fn spawn_thread(t: AdminThread) -> Result<(), RuntimeError> {
    let AdminThread {
        http,
        admin,
        metrics,
        health,
        supervisor,
        connection,
        namespace,
    } = t;
    if http.is_none() && admin.is_none() {
        return Ok(());
    }
    let died = supervisor.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name("gpulane-admin")
        .build()
        .map_err(|e| RuntimeError::Config(format!("starting the admin runtime: {e}")))?;
    let service = Service {
        supervisor,
        connection,
        namespace,
    };
    std::thread::Builder::new()
        .name("gpulane-admin".to_owned())
        .spawn(move || {
            let served = std::panic::catch_unwind(AssertUnwindSafe(|| {
                runtime.block_on(async move {
                    let http = async move {
                        match http {
                            Some(l) => match tokio::net::TcpListener::from_std(l) {
                                Ok(l) => crate::http::serve(l, metrics, health).await,
                                Err(e) => Err(e),
                            },
                            None => std::future::pending().await,
                        }
                    };
                    let grpc = async move {
                        match admin {
                            Some(l) => match tokio::net::TcpListener::from_std(l) {
                                Ok(l) => tonic::transport::Server::builder()
                                    .timeout(Duration::from_secs(30))
                                    .add_service(AdminServer::new(service))
                                    .serve_with_incoming(
                                        tonic::transport::server::TcpIncoming::from(l),
                                    )
                                    .await
                                    .map_err(|e| e.to_string()),
                                Err(e) => Err(e.to_string()),
                            },
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        r = http => format!("the metrics and probes endpoint stopped: {r:?}"),
                        r = grpc => format!("the admin API stopped: {r:?}"),
                    }
                })
            }));
            let why = served.unwrap_or_else(|panic| {
                format!(
                    "the admin thread panicked: {}",
                    crate::worker::panic_message(&*panic)
                )
            });
            died.died(why);
        })
        .map_err(|e| RuntimeError::Config(format!("starting the admin thread: {e}")))?;
    Ok(())
}

async fn client(args: &AdminArgs) -> Result<AdminClient<tonic::transport::Channel>, RuntimeError> {
    let address = args.admin_address.trim();
    let url = if address.contains("://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    let endpoint = tonic::transport::Endpoint::from_shared(url)
        .map_err(|e| RuntimeError::Config(format!("--admin-address {address:?}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30));
    let channel = endpoint.connect().await.map_err(|e| RuntimeError::Admin {
        address: address.to_owned(),
        message: format!(
            "cannot connect ({e}); is `gpulane run` running there with --admin-address {address}?"
        ),
    })?;
    Ok(AdminClient::new(channel))
}

fn admin_error(args: &AdminArgs, status: Status) -> RuntimeError {
    RuntimeError::Admin {
        address: args.admin_address.clone(),
        message: status.message().to_owned(),
    }
}

/// `gpulane status`.
pub(crate) async fn status_command(args: &StatusArgs) -> Result<(), RuntimeError> {
    let status = client(&args.admin)
        .await?
        .status(StatusRequest {
            skip_backlog: args.no_backlog,
        })
        .await
        .map_err(|s| admin_error(&args.admin, s))?
        .into_inner();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&status).expect("the status serializes; this is a bug")
        );
    } else {
        print_status(&status);
    }
    Ok(())
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

fn print_status(s: &StatusResponse) {
    println!(
        "gpulane {}  host {}  namespace {}  {}{}",
        s.version,
        s.host,
        s.namespace,
        if s.ready { "ready" } else { "NOT READY" },
        if s.draining { "  draining" } else { "" }
    );
    for p in &s.problems {
        println!("  problem: {p}");
    }
    println!("devices:");
    for d in &s.devices {
        let budget = d.budget.as_ref().map_or_else(String::new, |b| {
            format!(
                "  free {}  reserved {}  tasks {}/{}  polls {}",
                b.free_bytes
                    .map_or_else(|| format!("? ({})", b.reading_error), gib),
                gib(b.reserved_bytes),
                b.permits_out,
                b.permit_cap,
                b.idle_polls
            )
        });
        let error = if d.error.is_empty() {
            String::new()
        } else {
            format!("  ({})", d.error)
        };
        println!("  {:<40} {:<9}{budget}{error}", d.id, d.state);
    }
    println!("lanes:");
    println!(
        "  {:<48} {:<9} {:<8} {:>7} {:>8} {:>9} {:>7}",
        "task queue", "state", "kind", "running", "backlog", "age (s)", "pollers"
    );
    for l in &s.lanes {
        let (count, age, pollers) = match &l.backlog {
            Some(b) if b.error.is_empty() => (
                b.approximate_backlog_count.to_string(),
                format!("{:.1}", b.approximate_backlog_age_seconds),
                b.pollers.len().to_string(),
            ),
            Some(b) => (format!("? {}", b.error), String::new(), String::new()),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "  {:<48} {:<9} {:<8} {:>7} {:>8} {:>9} {:>7}",
            l.task_queue, l.state, l.kind, l.running, count, age, pollers
        );
    }
    println!("engines:");
    for e in &s.engines {
        println!(
            "  {:<24} {:<40} {:<14} {}  pending rows {}",
            e.model,
            e.device,
            e.kind,
            if e.alive { &e.health } else { "dead" },
            e.pending_rows
        );
    }
}

/// `gpulane drain`.
pub(crate) async fn drain_command(args: &DeviceTarget) -> Result<(), RuntimeError> {
    let r = client(&args.admin)
        .await?
        .drain(DrainRequest {
            device: args.card.clone(),
        })
        .await
        .map_err(|s| admin_error(&args.admin, s))?
        .into_inner();
    println!(
        "draining {}: shared lanes stopped; private lanes stop in {:.0} s",
        r.devices.join(", "),
        r.private_window_seconds
    );
    Ok(())
}

/// `gpulane resume`.
pub(crate) async fn resume_command(args: &DeviceTarget) -> Result<(), RuntimeError> {
    let r = client(&args.admin)
        .await?
        .resume(ResumeRequest {
            device: args.card.clone(),
        })
        .await
        .map_err(|s| admin_error(&args.admin, s))?
        .into_inner();
    println!("serving again: {}", r.devices.join(", "));
    Ok(())
}
