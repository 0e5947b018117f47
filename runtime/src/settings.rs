//! `gpulane run`'s flags turned, once and at start, into typed settings: sizes in bytes,
//! durations, socket addresses, the poller behaviour and versioning strategy sdk-core
//! takes. Everything after start-up reads these; no flag string is parsed again (per card
//! or per task), and a bad value stops the worker before any model loads, naming the flag.

use std::{
    net::{SocketAddr, ToSocketAddrs},
    path::PathBuf,
    time::Duration,
};

use gpulane_activities::{DataRoots, Limits};
use temporalio_client::Url;
use temporalio_common::worker::{WorkerDeploymentOptions, WorkerDeploymentVersion};
use temporalio_sdk_core::{PollerBehavior, WorkerVersioningStrategy};

use crate::{
    config::{CpuLane, DeviceArgs, GpuSelection, RunArgs, Secret},
    devices::parse_simulate_spec,
    RuntimeError,
};

/// Memory never promised to tasks, on a card or the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Headroom {
    Bytes(u64),
    /// A fraction of the card's total, in [0, 1).
    Fraction(f64),
}

impl Headroom {
    /// Parses `flag`'s value `v`.
    fn parse(flag: &str, v: &str) -> Result<Self, String> {
        let v = v.trim();
        if v.contains('.') {
            if let Ok(f) = v.parse::<f64>() {
                if !(0.0..1.0).contains(&f) {
                    return Err(format!(
                        "{flag} {v}: a fraction must be in [0, 1); for bytes write a unit, e.g. 2GiB"
                    ));
                }
                return Ok(Headroom::Fraction(f));
            }
        }
        crate::units::parse_bytes(v)
            .map(Headroom::Bytes)
            .map_err(|e| format!("{flag}: {e}"))
    }

    /// The headroom in bytes of `total` bytes.
    pub(crate) fn bytes(self, total: u64) -> u64 {
        match self {
            Headroom::Bytes(b) => b,
            Headroom::Fraction(f) => (total as f64 * f) as u64,
        }
    }
}

/// Where the devices come from and which are served; shared by `run`, `devices`, `bench`.
#[derive(Debug, Clone)]
pub(crate) struct DeviceSettings {
    /// `--simulate-gpus`: count and bytes per card.
    pub simulate: Option<(u32, u64)>,
    pub simulated_memory: Option<PathBuf>,
    /// `--simulated-host-memory`: the declared host's bytes.
    pub simulated_host: Option<u64>,
    /// `--simulated-id`: the simulated cards' stable name.
    pub simulated_id: Option<String>,
    pub gpus: GpuSelection,
    pub cpu_lane: CpuLane,
    pub host: String,
    pub nvml_lib: Option<PathBuf>,
    pub cuda_visible_devices: Option<String>,
}

impl DeviceSettings {
    pub(crate) fn from_args(args: &DeviceArgs) -> Result<Self, RuntimeError> {
        Ok(Self {
            simulate: args
                .simulate_gpus
                .as_deref()
                .map(parse_simulate_spec)
                .transpose()?,
            simulated_memory: match &args.simulated_memory {
                Some(_) if args.simulate_gpus.is_none() && args.simulated_host_memory.is_none() => {
                    return Err(RuntimeError::Config(
                        "--simulated-memory scripts simulated memory: add --simulate-gpus or \
                         --simulated-host-memory"
                            .to_owned(),
                    ))
                }
                other => other.clone(),
            },
            simulated_host: args
                .simulated_host_memory
                .as_deref()
                .map(|v| match crate::units::parse_bytes(v) {
                    Ok(0) => Err("must be positive".to_owned()),
                    other => other,
                })
                .transpose()
                .map_err(|e| {
                    RuntimeError::Config(format!(
                        "--simulated-host-memory: {e}; write a size such as 2GiB"
                    ))
                })?,
            simulated_id: match args.simulated_id.as_deref() {
                Some(id)
                    if id.is_empty()
                        || id.len() > 32
                        || !id
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') =>
                {
                    return Err(RuntimeError::Config(format!(
                        "--simulated-id {id:?}: use 1 to 32 ASCII letters, digits, '-' or '_' \
                         (it becomes part of the cards' UUIDs and queue names)"
                    )))
                }
                other => other.map(str::to_owned),
            },
            gpus: args.gpu_selection(),
            cpu_lane: args.cpu_lane,
            host: args.host.clone().unwrap_or_else(|| {
                hostname::get()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_else(|_| "unknown-host".to_owned())
            }),
            nvml_lib: args.nvml_lib.clone(),
            cuda_visible_devices: args.cuda_visible_devices.clone(),
        })
    }
}

/// TLS files and names for the Temporal connection.
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsSettings {
    pub server_ca: Option<PathBuf>,
    /// Client certificate and key, for mTLS.
    pub client: Option<(PathBuf, PathBuf)>,
    pub server_name: Option<String>,
}

/// How to reach Temporal.
#[derive(Debug, Clone)]
pub(crate) struct TemporalSettings {
    /// The address as given, for messages.
    pub address: String,
    pub url: Url,
    pub namespace: String,
    pub api_key: Option<Secret>,
    /// On when asked for, with any certificate, or with an API key.
    pub tls: Option<TlsSettings>,
}

/// Everything `gpulane run` needs besides the models, typed.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub devices: DeviceSettings,
    pub temporal: TemporalSettings,
    /// The identity prefix; each lane appends `/<device>/<queue>`.
    pub identity: String,
    pub limits: Limits,
    pub headroom: Headroom,
    /// `--host-memory-headroom`: host memory the CPU lanes never promise.
    pub host_headroom: Headroom,
    /// `--max-dataset-bytes`, resolved against the host's memory when the host is found
    /// (after the settings), into the one `DatasetMemory` every device's jobs share.
    pub max_dataset: Headroom,
    /// `--vram-cost` overrides by model name.
    pub vram_costs: Vec<(String, u64)>,
    pub max_concurrent_per_card: usize,
    pub max_concurrent_cpu: usize,
    pub memory_refresh: Duration,
    pub batch_wait: Duration,
    pub batch_rows: usize,
    /// `--gpu-attention`.
    pub gpu_attention: gpulane_models::Attention,
    pub metrics_address: Option<SocketAddr>,
    pub admin_address: Option<SocketAddr>,
    pub graceful_shutdown: Duration,
    pub drain_private: Duration,
    pub card_retry: Duration,
    pub pollers: PollerBehavior,
    pub max_activities_per_second: Option<f64>,
    pub max_task_queue_activities_per_second: Option<f64>,
    pub versioning: WorkerVersioningStrategy,
    pub model_queues: bool,
    pub test_faults: bool,
    /// Where `embed_dataset` reads and writes.
    pub data_roots: DataRoots,
}

/// `host:port` (or `off`) as a socket address; a name is resolved once, now.
fn address(flag: &str, v: &str) -> Result<Option<SocketAddr>, RuntimeError> {
    let v = v.trim();
    if v == "off" {
        return Ok(None);
    }
    v.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .map(Some)
        .ok_or_else(|| {
            RuntimeError::Config(format!(
                "{flag} {v:?} is not host:port (e.g. 127.0.0.1:9464; port 0 picks one) or `off`"
            ))
        })
}

/// `N`, `auto` or `auto:MIN-MAX`.
fn pollers(v: &str) -> Result<PollerBehavior, String> {
    let bad = || {
        format!("--pollers {v:?}: expected a count such as 2, `auto`, or `auto:MIN-MAX` such as auto:1-8")
    };
    let v = v.trim();
    let behavior = if let Some(range) = v.strip_prefix("auto") {
        let (minimum, maximum) = match range.strip_prefix(':') {
            None if range.is_empty() => (1, 8),
            Some(r) => {
                let (lo, hi) = r.split_once('-').ok_or_else(bad)?;
                (
                    lo.trim().parse().map_err(|_| bad())?,
                    hi.trim().parse().map_err(|_| bad())?,
                )
            }
            None => return Err(bad()),
        };
        PollerBehavior::Autoscaling {
            minimum,
            maximum,
            initial: minimum.max(2).min(maximum),
        }
    } else {
        PollerBehavior::SimpleMaximum(v.parse().map_err(|_| bad())?)
    };
    behavior
        .validate()
        .map_err(|e| format!("--pollers {v:?}: {e}"))?;
    Ok(behavior)
}

fn rate(flag: &str, v: Option<f64>) -> Result<Option<f64>, String> {
    match v {
        Some(r) if !(r.is_finite() && r > 0.0) => Err(format!(
            "{flag} {r}: must be a positive number of activities per second"
        )),
        other => Ok(other),
    }
}

impl Settings {
    /// Validates the flags into settings.
    pub(crate) fn from_args(args: &RunArgs) -> Result<Self, RuntimeError> {
        let config = RuntimeError::Config;
        let devices = DeviceSettings::from_args(&args.devices)?;
        let temporal = temporal_settings(args)?;
        let identity = args.identity.clone().unwrap_or_else(|| {
            // In a pod, its name says it all (and the PID is 1); elsewhere host and PID.
            match args.pod_name.as_deref().filter(|p| !p.trim().is_empty()) {
                Some(pod) => format!("gpulane@{}", pod.trim()),
                None => {
                    let host = args
                        .devices
                        .host
                        .clone()
                        .or_else(|| args.hostname_env.clone())
                        .unwrap_or_else(|| devices.host.clone());
                    format!("gpulane@{host}:{}", std::process::id())
                }
            }
        });
        let vram_costs = args
            .vram_cost
            .iter()
            .map(|c| {
                let (name, bytes) = c.split_once('=').ok_or_else(|| {
                    format!("--vram-cost {c:?}: expected NAME=BYTES, e.g. minilm=1GiB")
                })?;
                let bytes = crate::units::parse_bytes(bytes)
                    .map_err(|e| format!("--vram-cost {c:?}: {e}"))?;
                Ok((name.trim().to_owned(), bytes))
            })
            .collect::<Result<Vec<_>, String>>()
            .map_err(config)?;
        let build_id = args
            .build_id
            .clone()
            .unwrap_or_else(|| format!("gpulane-{}", env!("CARGO_PKG_VERSION")));
        let versioning = match &args.deployment_name {
            Some(name) => WorkerVersioningStrategy::WorkerDeploymentBased(
                WorkerDeploymentOptions::new(
                    WorkerDeploymentVersion::builder()
                        .deployment_name(name.clone())
                        .build_id(build_id)
                        .build(),
                )
                .use_worker_versioning(args.use_worker_versioning)
                .build(),
            ),
            None => WorkerVersioningStrategy::None { build_id },
        };
        Ok(Self {
            devices,
            temporal,
            identity,
            limits: Limits {
                max_texts: args.max_texts,
                max_text_chars: args.max_text_chars,
                max_total_chars: args.max_total_chars,
                max_result_bytes: args.max_result_bytes,
            },
            headroom: Headroom::parse("--vram-headroom", &args.vram_headroom).map_err(config)?,
            host_headroom: Headroom::parse("--host-memory-headroom", &args.host_memory_headroom)
                .map_err(config)?,
            max_dataset: Headroom::parse("--max-dataset-bytes", &args.max_dataset_bytes)
                .map_err(config)?,
            vram_costs,
            max_concurrent_per_card: args.max_concurrent_per_card,
            max_concurrent_cpu: args.max_concurrent_cpu,
            memory_refresh: Duration::from_millis(args.memory_refresh_ms.max(10)),
            batch_wait: Duration::from_millis(args.batch_wait_ms),
            batch_rows: args.batch_rows,
            gpu_attention: args.gpu_attention,
            metrics_address: address("--metrics-address", &args.metrics_address)?,
            admin_address: address("--admin-address", &args.admin_address)?,
            graceful_shutdown: Duration::from_secs(args.graceful_shutdown_secs),
            drain_private: Duration::from_secs(args.drain_private_secs),
            card_retry: Duration::from_secs(args.card_retry_secs),
            pollers: pollers(&args.pollers).map_err(config)?,
            max_activities_per_second: rate(
                "--max-activities-per-second",
                args.max_activities_per_second,
            )
            .map_err(config)?,
            max_task_queue_activities_per_second: rate(
                "--max-task-queue-activities-per-second",
                args.max_task_queue_activities_per_second,
            )
            .map_err(config)?,
            versioning,
            model_queues: args.model_queues,
            test_faults: args.test_faults,
            data_roots: DataRoots::parse(&args.data_roots).map_err(config)?,
        })
    }

    /// The longest a stop can take: the private lanes' window, then the running
    /// activities' grace, then a margin for core to fail them back and close.
    pub(crate) fn shutdown_deadline(&self) -> Duration {
        self.drain_private + self.graceful_shutdown + Duration::from_secs(15)
    }
}

fn temporal_settings(args: &RunArgs) -> Result<TemporalSettings, RuntimeError> {
    let tls_on = args.tls
        || args.api_key.is_some()
        || args.tls_server_ca_cert_path.is_some()
        || args.tls_client_cert_path.is_some();
    let address = args.address.trim().to_owned();
    let url_text = if address.contains("://") {
        address.clone()
    } else {
        format!("{}://{address}", if tls_on { "https" } else { "http" })
    };
    let url = Url::parse(&url_text).map_err(|e| {
        RuntimeError::Config(format!("--address {address:?} is not host:port ({e})"))
    })?;
    let tls = tls_on.then(|| TlsSettings {
        server_ca: args.tls_server_ca_cert_path.clone(),
        client: args
            .tls_client_cert_path
            .clone()
            .zip(args.tls_client_key_path.clone()),
        server_name: args.tls_server_name.clone(),
    });
    Ok(TemporalSettings {
        address,
        url,
        namespace: args.namespace.clone(),
        api_key: args.api_key.clone(),
        tls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::run_args;

    fn settings(extra: &[&str]) -> Result<Settings, RuntimeError> {
        Settings::from_args(&run_args(extra))
    }

    #[test]
    fn headroom_is_bytes_or_a_fraction() {
        let gib = 1u64 << 30;
        let h = |v: &str| settings(&["--vram-headroom", v]).map(|s| s.headroom);
        assert_eq!(settings(&[]).unwrap().headroom.bytes(80 * gib), 4 * gib);
        assert_eq!(h("2GiB").unwrap().bytes(80 * gib), 2 * gib);
        assert_eq!(h("0.25").unwrap().bytes(8 * gib), 2 * gib);
        let e = h("1.5").unwrap_err().to_string();
        assert!(e.contains("[0, 1)"), "{e}");
        assert!(h("lots").is_err());
    }

    #[test]
    fn vram_cost_overrides_parse() {
        let s = settings(&["--vram-cost", "a=1GiB,b=512MiB"]).unwrap();
        assert_eq!(
            s.vram_costs,
            vec![("a".into(), 1 << 30), ("b".into(), 512 << 20)]
        );
        assert!(settings(&["--vram-cost", "nope"]).is_err());
    }

    #[test]
    fn addresses_parse_once_and_off_disables() {
        let s = settings(&["--metrics-address", "off", "--admin-address", "127.0.0.1:0"]).unwrap();
        assert_eq!(s.metrics_address, None);
        assert_eq!(s.admin_address.unwrap().port(), 0);
        let e = settings(&["--admin-address", "nowhere"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--admin-address") && e.contains("off"), "{e}");
    }

    #[test]
    fn pollers_are_a_count_or_autoscaling() {
        assert!(matches!(
            settings(&[]).unwrap().pollers,
            PollerBehavior::SimpleMaximum(2)
        ));
        assert!(matches!(
            settings(&["--pollers", "auto"]).unwrap().pollers,
            PollerBehavior::Autoscaling {
                minimum: 1,
                maximum: 8,
                initial: 2
            }
        ));
        assert!(matches!(
            settings(&["--pollers", "auto:2-16"]).unwrap().pollers,
            PollerBehavior::Autoscaling {
                minimum: 2,
                maximum: 16,
                ..
            }
        ));
        for bad in ["0", "x", "auto:3", "auto:5-2", "autox"] {
            assert!(settings(&["--pollers", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn rates_must_be_positive() {
        let s = settings(&["--max-activities-per-second", "2.5"]).unwrap();
        assert_eq!(s.max_activities_per_second, Some(2.5));
        assert!(settings(&["--max-task-queue-activities-per-second", "0"]).is_err());
    }

    #[test]
    fn identity_names_the_pod_or_the_host_and_pid() {
        let s = settings(&["--pod-name", "gpulane-7f9c", "--host", "h"]).unwrap();
        assert_eq!(s.identity, "gpulane@gpulane-7f9c");
        let s = settings(&["--host", "box-1"]).unwrap();
        assert_eq!(s.identity, format!("gpulane@box-1:{}", std::process::id()));
        let s = settings(&["--identity", "mine"]).unwrap();
        assert_eq!(s.identity, "mine");
    }

    #[test]
    fn a_deployment_names_its_version() {
        let s = settings(&["--deployment-name", "embedders", "--build-id", "b7"]).unwrap();
        let WorkerVersioningStrategy::WorkerDeploymentBased(o) = s.versioning else {
            panic!("not deployment-based")
        };
        assert_eq!(o.version.deployment_name, "embedders");
        assert_eq!(o.version.build_id, "b7");
        assert!(!o.use_worker_versioning);
        assert_eq!(
            settings(&[]).unwrap().versioning.build_id(),
            format!("gpulane-{}", env!("CARGO_PKG_VERSION"))
        );
    }

    #[test]
    fn tls_follows_keys_and_certificates() {
        assert!(settings(&[]).unwrap().temporal.tls.is_none());
        let s = settings(&["--api-key", "k"]).unwrap();
        assert!(s.temporal.tls.is_some());
        assert_eq!(s.temporal.url.scheme(), "https");
    }
}
