//! `/metrics`, `/healthz` and `/readyz` over HTTP/1.1, with hyper and axum rather than a
//! hand-written parser. Probes and scrapes must stay answerable whatever clients do: a
//! connection must send its request head within [`HEADER_TIMEOUT`], lives at most
//! [`CONNECTION_LIFETIME`], and at most [`MAX_CONNECTIONS`] are open at once (more are
//! closed as they arrive rather than queued), so idle or slow clients cannot exhaust file
//! descriptors or hold a scrape up.

use std::{sync::Arc, time::Duration};

use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, sync::Semaphore};

use crate::{health::Health, metrics::Metrics};

const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
const MAX_CONNECTIONS: usize = 512;

#[derive(Clone)]
struct Probes {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

async fn metrics(State(p): State<Probes>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        p.metrics.render(),
    )
}

/// 200 `ok`, or 503 with one problem per line.
fn verdict(problems: Vec<String>, ok: &'static str) -> (StatusCode, String) {
    if problems.is_empty() {
        (StatusCode::OK, format!("{ok}\n"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            problems.iter().map(|p| format!("{p}\n")).collect(),
        )
    }
}

async fn healthz(State(p): State<Probes>) -> impl IntoResponse {
    verdict(p.health.liveness(), "ok")
}

async fn readyz(State(p): State<Probes>) -> impl IntoResponse {
    verdict(p.health.readiness(), "ready")
}

async fn not_found() -> impl IntoResponse {
    (StatusCode::NOT_FOUND, "try /metrics, /healthz or /readyz\n")
}

/// Serves the probes and metrics on `listener` until the listener fails.
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(self::metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .with_state(Probes { metrics, health });
    let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of file descriptors and the like pass; wait a little rather than spin.
            Err(e) if is_transient(&e) => {
                tracing::warn!(error = %e, "metrics endpoint: accept failed; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::debug!(
                "metrics endpoint: {MAX_CONNECTIONS} connections open; closing a new one"
            );
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            if tokio::time::timeout(CONNECTION_LIFETIME, conn.as_mut())
                .await
                .is_err()
            {
                // Old enough: finish the response in flight, if any, then close.
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(HEADER_TIMEOUT, conn).await;
            }
            drop(permit);
        });
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock | OutOfMemory
    ) || matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn probes_answer_and_idle_connections_do_not_block_them() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::default());
        let health = Health::new(metrics.clone());
        health.set_started();
        tokio::spawn(serve(listener, metrics, health.clone()));
        // Idle clients that never send a request.
        let mut idle = Vec::new();
        for _ in 0..200 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let m = get(addr, "/metrics").await;
        assert!(m.starts_with("HTTP/1.1 200"), "{m}");
        assert!(m.contains("gpulane_ready 1"), "{m}");
        let r = get(addr, "/readyz").await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.ends_with("ready\n"),
            "{r}"
        );
        health.set_draining(true);
        let r = get(addr, "/readyz").await;
        assert!(
            r.starts_with("HTTP/1.1 503") && r.contains("draining"),
            "{r}"
        );
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));
    }
}
