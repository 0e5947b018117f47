//! Command line and environment, in one clap struct: the low level, as typed. The
//! `settings` module turns these into typed settings once, at start (ripgrep's low-args →
//! high-args), so nothing re-parses a flag later. Temporal connection settings use
//! Temporal's own environment variable names so an existing `temporal` CLI setup works.

use std::{fmt, path::PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

/// gpulane: a Temporal activity worker that puts GPUs (and CPUs) behind task queues.
#[derive(Debug, Parser)]
#[command(name = "gpulane", version = env!("GPULANE_LONG_VERSION"), about)]
pub struct Cli {
    #[command(subcommand)]
    /// What to do.
    pub command: Command,

    /// Threads for CPU inference (candle's matrix multiplies), set once at start (as
    /// RAYON_NUM_THREADS, which wins when set). Default: the cores this process may use,
    /// cgroup quotas and CPU affinity included.
    #[arg(long, global = true, env = "GPULANE_CPU_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    pub cpu_threads: Option<u16>,

    /// The widest vector extension gpulane's CPU kernels may use: auto (what the CPU has,
    /// AMX tiles for int8 included), avx512 (VNNI included, AMX not), avx2 or baseline.
    /// Lower levels run the narrower routes on a wider CPU: to test or measure what an
    /// AVX2-only CPU gets, or to step around a route that misbehaves. candle's matmul
    /// keeps its own detection.
    #[arg(long, global = true, env = "GPULANE_CPU_ISA", value_enum, default_value_t = CpuIsaArg::Auto)]
    pub cpu_isa: CpuIsaArg,
}

/// `--cpu-isa`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CpuIsaArg {
    /// What the CPU has.
    Auto,
    /// AVX-512 at most (VNNI included where the CPU has it; AMX's tiles not).
    Avx512,
    /// AVX2 with FMA at most.
    Avx2,
    /// The portable routes only.
    Baseline,
}

impl CpuIsaArg {
    /// The cap it sets, if any.
    pub fn cap(self) -> Option<gpulane_models::CpuIsa> {
        use gpulane_models::CpuIsa;
        match self {
            CpuIsaArg::Auto => None,
            CpuIsaArg::Avx512 => Some(CpuIsa::Avx512Vnni),
            CpuIsaArg::Avx2 => Some(CpuIsa::Avx2),
            CpuIsaArg::Baseline => Some(CpuIsa::Baseline),
        }
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Connect to Temporal and serve activity task queues until stopped (Ctrl-C / SIGTERM).
    Run(Box<RunArgs>),
    /// Print the device inventory and the exact task queue names this host would serve.
    Devices(DeviceArgs),
    /// Load every declared model on the CPU and list what would be served.
    Models(ModelArgs),
    /// Measure embedding throughput of one model per device and batch size (texts/s,
    /// tokens/s), optionally writing the vectors for correctness checks.
    Bench(Box<crate::bench::BenchArgs>),
    /// Read each card's free memory now and print how many activities of the declared
    /// models it would admit, with the same budget `run` uses; connects to nothing.
    Admission(Box<RunArgs>),
    /// Ask a running worker (its admin API) for its devices, lanes with their backlog,
    /// card budgets and engines.
    Status(StatusArgs),
    /// Take a card (or every device) of a running worker out of service: its shared lanes
    /// stop polling at once, its private lane after --drain-private-secs.
    Drain(DeviceTarget),
    /// Put a drained card (or every drained device) of a running worker back in service.
    Resume(DeviceTarget),
    /// Print the JSON Schema of every activity's input and result, the failure types and
    /// the queue naming rules (the contract the client packages follow).
    Schema,
    /// Run gpulane's own kernels on a device against the CPU kernels, in every dtype the
    /// device runs (scripts/gpu-check.sh runs it on a card first).
    #[command(hide = true)]
    KernelCheck(KernelCheckArgs),
}

/// `gpulane kernel-check`.
#[derive(Debug, Clone, Args)]
pub struct KernelCheckArgs {
    /// `cpu`, or `cuda:N` (the CUDA ordinal; needs the cuda build), as `bench` takes it.
    #[arg(long, default_value = "cpu")]
    pub device: crate::bench::BenchDevice,
    /// Also write every check as JSON (`{"device", "checks": [{"op", "case", "dtype",
    /// "max_abs_diff", "max_scaled_diff", "bound", "ok"}]}`; the bound is on the scaled
    /// difference, |device − reference| / max(1, |reference|)).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Where a running worker's admin API listens; shared by `status`, `drain`, `resume`.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// The worker's --admin-address (host:port).
    #[arg(long, env = "GPULANE_ADMIN_ADDRESS", default_value = "127.0.0.1:9465")]
    pub admin_address: String,
}

/// `gpulane status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// Which worker.
    #[command(flatten)]
    pub admin: AdminArgs,
    /// Print the status as JSON (the admin API's StatusResponse, proto field names as
    /// keys; documented in proto/admin.proto) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Do not read each lane's backlog from Temporal.
    #[arg(long)]
    pub no_backlog: bool,
}

/// `gpulane drain` and `gpulane resume`.
#[derive(Debug, Clone, Args)]
pub struct DeviceTarget {
    /// Which worker.
    #[command(flatten)]
    pub admin: AdminArgs,
    /// The card's NVML UUID (as `gpulane status` lists it), `cpu`, or `all`.
    #[arg(long)]
    pub card: String,
}

/// Which models to serve; shared by `run` and `models`.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A model to serve, as SOURCE or NAME=SOURCE, where SOURCE is a directory or a
    /// Hugging Face repo id (org/name) from the local cache or downloaded (repeatable; the
    /// first embedder and the first cross-encoder are the defaults; NAME defaults to the
    /// last path segment).
    #[arg(long = "model", env = "GPULANE_MODEL", value_delimiter = ',')]
    pub models: Vec<String>,

    /// A TOML file of [[model]] tables (name, source, dtype, cpu_dtype, lanes,
    /// max_batch_tokens, vram_cost), served after the --model ones.
    #[arg(long, env = "GPULANE_MODELS_FILE")]
    pub models_file: Option<PathBuf>,

    /// What the CPU lanes compute in: f32 (exact, the default) or int8 (dense layers
    /// quantized dynamically: faster, results within cosine 0.99 and named `int8`). A
    /// models file's `cpu_dtype` overrides it per model.
    #[arg(long, env = "GPULANE_CPU_DTYPE", default_value = "f32", value_parser = ["f32", "int8"])]
    pub cpu_dtype: String,

    /// Where models named by Hugging Face repo id come from.
    #[command(flatten)]
    pub hub: HubArgs,
}

/// Where a model named by Hugging Face repo id comes from; shared by `run`, `models` and
/// `bench`. The variables are the ones huggingface_hub reads, so a machine set up for
/// Python tools is set up for gpulane.
#[derive(Debug, Clone, Default, Args)]
pub struct HubArgs {
    /// Hugging Face home; its hub/ folder is the model cache (default ~/.cache/huggingface).
    #[arg(long, env = "HF_HOME")]
    pub hf_home: Option<PathBuf>,

    /// Never download: use only directories and the local cache.
    #[arg(long, env = "HF_HUB_OFFLINE", value_parser = clap::builder::FalseyValueParser::new())]
    pub hf_offline: bool,

    /// The hub to download from: a mirror, or a hub inside your network (default
    /// https://huggingface.co).
    #[arg(long, env = "HF_ENDPOINT", value_parser = hub_endpoint)]
    pub hf_endpoint: Option<String>,
}

/// A count that must be at least 1, refused when the flags are parsed (before any model
/// loads) rather than deep in start-up.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// An http(s) base URL, without a trailing slash (hf-hub appends `/{repo}/resolve/...`).
fn hub_endpoint(s: &str) -> Result<String, String> {
    let url = s.trim_end_matches('/');
    let host = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .unwrap_or("");
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(format!(
            "{s:?} is not an http(s) base URL such as https://huggingface.co"
        ));
    }
    Ok(url.to_owned())
}

impl HubArgs {
    /// The Hugging Face home, `--hf-home` or ~/.cache/huggingface.
    pub fn home(&self) -> PathBuf {
        self.hf_home.clone().unwrap_or_else(|| {
            std::env::home_dir()
                .unwrap_or_else(|| "/".into())
                .join(".cache/huggingface")
        })
    }
}

/// An API key that never prints.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// Which lanes to serve for the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CpuLane {
    /// Serve `cpu-tools` only when no GPU lane is served.
    Auto,
    /// Always serve `cpu-tools`.
    On,
    /// Never serve `cpu-tools`.
    Off,
}

/// Where devices come from and which ones to serve; shared by `run` and `devices`.
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Declare simulated GPUs instead of reading NVML, as COUNTxSIZE (e.g. 2x16GiB). They
    /// compute on the CPU and are marked `simulated` in logs and every result.
    #[arg(long, env = "GPULANE_SIMULATE_GPUS")]
    pub simulate_gpus: Option<String>,

    /// Which cards to serve: `all`, `none`, or a comma list of NVML indices or UUIDs.
    /// Applied after CUDA_VISIBLE_DEVICES.
    #[arg(long, env = "GPULANE_GPUS", default_value = "all")]
    pub gpus: String,

    /// Whether to serve the `cpu-tools` lane: auto (only without GPU lanes), on, off.
    #[arg(long, env = "GPULANE_CPU_LANE", value_enum, default_value_t = CpuLane::Auto)]
    pub cpu_lane: CpuLane,

    /// Host name used in private queue names and worker identity (default: the OS host
    /// name). Set it when containers get random host names.
    #[arg(long, env = "GPULANE_HOST")]
    pub host: Option<String>,

    /// Path of the NVML library (default: the system's libnvidia-ml.so.1).
    #[arg(long, env = "GPULANE_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,

    /// With --simulate-gpus or --simulated-host-memory: a JSON file mapping a card's index
    /// (as a string), or "host", to the bytes other tenants leave free, e.g.
    /// {"0": 0, "host": 1073741824}, re-read at every memory refresh.
    #[arg(long, env = "GPULANE_SIMULATED_MEMORY")]
    pub simulated_memory: Option<PathBuf>,

    /// Declare the host's memory (e.g. 2GiB) instead of reading it, for tests and demos of
    /// the CPU lanes' admission: engines and tokenizations account what they take in it,
    /// and a pass that would not fit fails as out of memory.
    #[arg(long, env = "GPULANE_SIMULATED_HOST_MEMORY")]
    pub simulated_host_memory: Option<String>,

    /// With --simulate-gpus: names the simulated cards GPU-SIM-NAME-0, GPU-SIM-NAME-1, …
    /// so their private queues stay the same across restarts (tests, demos). Without it
    /// each process picks a random name, so two simulated workers never share a queue.
    /// Ignored without --simulate-gpus.
    #[arg(long, env = "GPULANE_SIMULATED_ID")]
    pub simulated_id: Option<String>,

    /// Which CUDA cards this process may use (indices or UUIDs), as CUDA reads it.
    #[arg(long, env = "CUDA_VISIBLE_DEVICES", hide = true)]
    pub cuda_visible_devices: Option<String>,
}

/// `gpulane run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Devices and lanes.
    #[command(flatten)]
    pub devices: DeviceArgs,

    /// Temporal frontend, host:port.
    #[arg(long, env = "TEMPORAL_ADDRESS", default_value = "localhost:7233")]
    pub address: String,

    /// Temporal namespace.
    #[arg(long, env = "TEMPORAL_NAMESPACE", default_value = "default")]
    pub namespace: String,

    /// API key for Temporal Cloud or another authenticating frontend (implies TLS).
    #[arg(long, env = "TEMPORAL_API_KEY", hide_env_values = true)]
    pub api_key: Option<Secret>,

    /// Use TLS with the system's roots (implied by the other TLS flags and an API key).
    #[arg(long, env = "TEMPORAL_TLS", value_parser = clap::builder::FalseyValueParser::new())]
    pub tls: bool,

    /// PEM file of the CA that signed the server's certificate.
    #[arg(long, env = "TEMPORAL_TLS_SERVER_CA_CERT_PATH")]
    pub tls_server_ca_cert_path: Option<PathBuf>,

    /// PEM file of this client's certificate, for mTLS.
    #[arg(
        long,
        env = "TEMPORAL_TLS_CLIENT_CERT_PATH",
        requires = "tls_client_key_path"
    )]
    pub tls_client_cert_path: Option<PathBuf>,

    /// PEM file of this client's private key, for mTLS.
    #[arg(
        long,
        env = "TEMPORAL_TLS_CLIENT_KEY_PATH",
        requires = "tls_client_cert_path"
    )]
    pub tls_client_key_path: Option<PathBuf>,

    /// Server name to verify in the server's certificate (default: from the address).
    #[arg(long, env = "TEMPORAL_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,

    /// Worker identity prefix shown in Temporal's UI (default: gpulane@POD_NAME in a pod,
    /// else gpulane@HOST:PID). `/<device>/<task queue>` is appended per lane, so every
    /// poller names the card it serves.
    #[arg(long, env = "GPULANE_IDENTITY")]
    pub identity: Option<String>,

    /// The pod's name, which the default identity uses (set it from the Downward API).
    #[arg(long, env = "POD_NAME", hide = true)]
    pub pod_name: Option<String>,

    /// The host name the environment gives (containers set it to the pod's name).
    #[arg(long = "hostname-env", env = "HOSTNAME", hide = true)]
    pub hostname_env: Option<String>,

    /// Also serve a model queue per model (`gpu-tools@<model>`, `cpu-tools@<model>`),
    /// polled only by workers that serve the model; a models file can turn it on per
    /// model (`model_queue = true`).
    #[arg(long, env = "GPULANE_MODEL_QUEUES", value_parser = clap::builder::FalseyValueParser::new())]
    pub model_queues: bool,

    /// Activity pollers per lane: a count (e.g. 2), or `auto` / `auto:MIN-MAX` for
    /// sdk-core's poller autoscaling (default range 1-8). Each poll waits on a slot.
    #[arg(long, env = "GPULANE_POLLERS", default_value = "2")]
    pub pollers: String,

    /// Most activities per second each lane of this worker starts (sdk-core's
    /// max_worker_activities_per_second); unset = no limit.
    #[arg(long, env = "GPULANE_MAX_ACTIVITIES_PER_SECOND")]
    pub max_activities_per_second: Option<f64>,

    /// Most activities per second the server dispatches from each lane's task queue, to
    /// all its workers together (max_task_queue_activities_per_second); unset = no limit.
    #[arg(long, env = "GPULANE_MAX_TASK_QUEUE_ACTIVITIES_PER_SECOND")]
    pub max_task_queue_activities_per_second: Option<f64>,

    /// Worker Deployment name, for versioned rollouts (with --build-id).
    #[arg(long, env = "GPULANE_DEPLOYMENT_NAME", requires = "build_id")]
    pub deployment_name: Option<String>,

    /// Build id of this worker (default: gpulane-VERSION); with --deployment-name it is
    /// the Worker Deployment Version's build id.
    #[arg(long, env = "GPULANE_BUILD_ID")]
    pub build_id: Option<String>,

    /// With --deployment-name: opt in to Worker Versioning, so this worker takes only
    /// tasks routed to its version (set it current with `temporal worker deployment
    /// set-current-version`). Off: the version only identifies the worker.
    #[arg(long, env = "GPULANE_USE_WORKER_VERSIONING", requires = "deployment_name", value_parser = clap::builder::FalseyValueParser::new())]
    pub use_worker_versioning: bool,

    /// The models to serve.
    #[command(flatten)]
    pub models: ModelArgs,

    /// Most activities running (or polls waiting) at once on one card, over all its lanes.
    #[arg(long, env = "GPULANE_MAX_CONCURRENT_PER_CARD", default_value_t = 8, value_parser = at_least_one())]
    pub max_concurrent_per_card: usize,

    /// Card memory never promised to tasks: bytes (e.g. 2GiB) or a fraction of the card's
    /// total (e.g. 0.1).
    #[arg(long, env = "GPULANE_VRAM_HEADROOM", default_value = "0.05")]
    pub vram_headroom: String,

    /// Host memory the CPU lanes never promise to tasks: bytes (e.g. 1GiB) or a fraction
    /// of the host's memory, or of its cgroup's limit when lower (e.g. 0.1).
    #[arg(long, env = "GPULANE_HOST_MEMORY_HEADROOM", default_value = "0.05")]
    pub host_memory_headroom: String,

    /// Per-task working memory of a model, overriding the estimate: NAME=BYTES (e.g.
    /// bge-m3=3GiB). Repeatable.
    #[arg(long, env = "GPULANE_VRAM_COST", value_delimiter = ',')]
    pub vram_cost: Vec<String>,

    /// Milliseconds between card memory readings (NVML or the simulation file).
    #[arg(long, env = "GPULANE_MEMORY_REFRESH_MS", default_value_t = 500)]
    pub memory_refresh_ms: u64,

    /// Most activities running at once on the CPU lanes (together). Concurrent activities
    /// share forward passes, so this also bounds how many calls one round can gather.
    #[arg(long, env = "GPULANE_MAX_CONCURRENT_CPU", default_value_t = 32, value_parser = at_least_one())]
    pub max_concurrent_cpu: usize,

    /// Milliseconds a model's engine waits for more activities to fill a batch after the
    /// first one arrives; 0 runs each activity's texts on their own.
    #[arg(long, env = "GPULANE_BATCH_WAIT_MS", default_value_t = 2)]
    pub batch_wait_ms: u64,

    /// Most texts (or query-document pairs) in one forward pass, over all the activities
    /// batched together; a model's max_batch_tokens also bounds it.
    #[arg(long, env = "GPULANE_BATCH_ROWS", default_value_t = 32, value_parser = at_least_one())]
    pub batch_rows: usize,

    /// How cards run attention and the element-wise steps: `varlen` (gpulane's own CUDA
    /// kernels: packed attention with no padding, fused bias+GELU and
    /// bias+residual+LayerNorm) or `padded` (candle's ops throughout, attention over rows
    /// padded per length group: the route before gpulane's kernels, to compare with or
    /// to fall back on). The CPU in f32 always runs its own kernels.
    #[arg(long, env = "GPULANE_GPU_ATTENTION", default_value = "varlen")]
    pub gpu_attention: gpulane_models::Attention,

    /// Where to serve /metrics, /healthz and /readyz (host:port; port 0 picks one; `off`
    /// disables).
    #[arg(
        long,
        env = "GPULANE_METRICS_ADDRESS",
        default_value = "127.0.0.1:9464"
    )]
    pub metrics_address: String,

    /// Where to serve the admin API (gRPC: status, drain, resume), host:port; loopback by
    /// default, since it can take cards out of service; port 0 picks one; `off` disables.
    #[arg(long, env = "GPULANE_ADMIN_ADDRESS", default_value = "127.0.0.1:9465")]
    pub admin_address: String,

    /// Seconds a draining card's private lane keeps serving after its shared lanes stop,
    /// so follow-ups pinned to the card land (on drain and on SIGTERM).
    #[arg(long, env = "GPULANE_DRAIN_PRIVATE_SECS", default_value_t = 5)]
    pub drain_private_secs: u64,

    /// Seconds between retries of a card that could not be read at start.
    #[arg(long, env = "GPULANE_CARD_RETRY_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub card_retry_secs: u64,

    /// Where `embed_dataset` may read datasets and write parts: `file:///absolute/dir`
    /// or `s3://bucket/prefix` (repeatable). S3 endpoint and credentials come from the
    /// standard AWS environment variables. None: `embed_dataset` is refused.
    #[arg(long = "data-root", env = "GPULANE_DATA_ROOT", value_delimiter = ',')]
    pub data_roots: Vec<String>,

    /// Test-only fault hooks (texts that kill an engine or panic an activity). Never in
    /// service.
    #[arg(long, env = "GPULANE_TEST_FAULTS", hide = true, value_parser = clap::builder::FalseyValueParser::new())]
    pub test_faults: bool,

    /// Most texts in one embed call.
    #[arg(long, env = "GPULANE_MAX_TEXTS", default_value_t = 1024)]
    pub max_texts: usize,

    /// Most characters in one text.
    #[arg(long, env = "GPULANE_MAX_TEXT_CHARS", default_value_t = 100_000)]
    pub max_text_chars: usize,

    /// Most characters over all texts of one call.
    #[arg(long, env = "GPULANE_MAX_TOTAL_CHARS", default_value_t = 1_000_000)]
    pub max_total_chars: usize,

    /// Largest activity result in bytes of JSON; Temporal refuses payloads over 2 MB by
    /// default. Raise it only if your server's blob size limit is higher.
    #[arg(long, env = "GPULANE_MAX_RESULT_BYTES", default_value_t = 2_000_000)]
    pub max_result_bytes: usize,

    /// Most the worker's `embed_dataset` activities hold of their sources together: bytes
    /// (e.g. 4GiB) or a fraction of the host's memory, or of its cgroup's limit when lower
    /// (e.g. 0.25). A job holds every id of the file and its own rows' texts (a shard reads
    /// no other texts), counted as read. A job that alone would pass it fails with
    /// InvalidInput before the texts are held; one that finds it held by other jobs waits
    /// for its turn, then reads its source again (jobs take turns one at a time).
    #[arg(long, env = "GPULANE_MAX_DATASET_BYTES", default_value = "0.125")]
    pub max_dataset_bytes: String,

    /// Seconds running activities get to finish once their lane stops polling (drain or
    /// SIGTERM); then they are failed back to Temporal, retryably (WorkerShutdown), so
    /// another worker takes them at once.
    #[arg(long, env = "GPULANE_GRACEFUL_SHUTDOWN_SECS", default_value_t = 30)]
    pub graceful_shutdown_secs: u64,
}

/// Which cards `--gpus` selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuSelection {
    All,
    None,
    /// NVML indices or UUIDs.
    Some(Vec<String>),
}

impl DeviceArgs {
    pub(crate) fn gpu_selection(&self) -> GpuSelection {
        match self.gpus.trim() {
            "all" | "" => GpuSelection::All,
            "none" => GpuSelection::None,
            list => GpuSelection::Some(list.split(',').map(|s| s.trim().to_owned()).collect()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn zero_counts_are_refused_when_parsing() {
        for flag in [
            "--max-concurrent-per-card",
            "--max-concurrent-cpu",
            "--batch-rows",
        ] {
            let argv = ["gpulane", "run", "--model", "/m", flag, "0"];
            assert!(Cli::try_parse_from(argv).is_err(), "{flag} 0 was accepted");
        }
        assert_eq!(run_args(&["--batch-rows", "1"]).batch_rows, 1);
    }

    #[test]
    fn hub_endpoints_are_http_urls_without_a_trailing_slash() {
        let a = run_args(&["--hf-endpoint", "https://hf-mirror.com/"]);
        assert_eq!(
            a.models.hub.hf_endpoint.as_deref(),
            Some("https://hf-mirror.com")
        );
        let mut argv = vec![
            "gpulane",
            "run",
            "--model",
            "/m",
            "--hf-endpoint",
            "hf-mirror.com",
        ];
        let err = Cli::try_parse_from(argv.clone()).unwrap_err().to_string();
        assert!(err.contains("not an http(s) base URL"), "{err}");
        argv[5] = "https://";
        assert!(Cli::try_parse_from(argv).is_err());
    }

    pub(crate) fn run_args(extra: &[&str]) -> RunArgs {
        let mut argv = vec!["gpulane", "run", "--model", "/m"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(a) => *a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn gpu_attention_is_varlen_unless_told_padded() {
        use gpulane_models::Attention;
        assert_eq!(run_args(&[]).gpu_attention, Attention::Varlen);
        let a = run_args(&["--gpu-attention", "padded"]);
        assert_eq!(a.gpu_attention, Attention::Padded);
        let Err(e) = Cli::try_parse_from([
            "gpulane",
            "run",
            "--model",
            "/m",
            "--gpu-attention",
            "flash",
        ]) else {
            panic!("an unknown route is refused");
        };
        let e = e.to_string();
        assert!(e.contains("varlen or padded"), "{e}");
    }

    #[test]
    fn boolean_variables_take_1_and_true() {
        std::env::set_var("HF_HUB_OFFLINE", "1");
        let a = run_args(&[]);
        std::env::remove_var("HF_HUB_OFFLINE");
        assert!(a.models.hub.hf_offline);
    }

    #[test]
    fn api_key_never_prints() {
        let s: Secret = "hunter2".parse().unwrap();
        assert!(!format!("{s:?}").contains("hunter2"));
    }

    #[test]
    fn gpu_selection_parses() {
        let mut a = Cli::try_parse_from(["gpulane", "devices"]).unwrap();
        let Command::Devices(ref mut d) = a.command else {
            panic!()
        };
        assert_eq!(d.gpu_selection(), GpuSelection::All);
        d.gpus = "none".into();
        assert_eq!(d.gpu_selection(), GpuSelection::None);
        d.gpus = "0, GPU-x".into();
        assert_eq!(
            d.gpu_selection(),
            GpuSelection::Some(vec!["0".into(), "GPU-x".into()])
        );
    }
}
