//! `gpulane bench`: embedding throughput of one model on each device asked for, at one or
//! more batch sizes, through the same [`Engine`] the worker serves activities with.
//!
//! Each measured run submits the whole corpus as one `embed` call and times it to the
//! returned vectors (which are copied to the host, so the device has finished). The
//! median of `--repeat` runs is reported. `--dump` writes the vectors of the first
//! measured run, for correctness checks against sentence-transformers
//! (`scripts/gpu-check.sh` does both).

use std::{
    io::Write,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use clap::Args;
use gpulane_models::{
    DType, EmbedOptions, Engine, EngineDevice, EngineOptions, SentenceTransformerDir,
};
use serde::Serialize;

use crate::{
    config::{DeviceArgs, HubArgs, ModelArgs},
    devices::GpuDevice,
    settings::DeviceSettings,
    startup::{inventory, resolve_models},
    RuntimeError,
};

/// `gpulane bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// The embedder to measure, as SOURCE or NAME=SOURCE: a directory, or a Hugging Face
    /// repo id (org/name) from the local cache or downloaded (see --hf-home,
    /// HF_HUB_OFFLINE).
    #[arg(long, env = "GPULANE_BENCH_MODEL")]
    pub model: String,

    /// The texts: a UTF-8 file, one text per line; blank lines are skipped. All of them
    /// go to the engine as one embed call per run.
    #[arg(long, env = "GPULANE_BENCH_CORPUS")]
    pub corpus: PathBuf,

    /// Where to run, comma separated: `cpu`, `cuda:N` (CUDA ordinal), `cuda:GPU-UUID`
    /// (a card by NVML UUID, or a unique prefix of it), or `all` (every visible card,
    /// then the CPU). CUDA devices need a gpulane built with `--features cuda`.
    #[arg(
        long,
        env = "GPULANE_BENCH_DEVICE",
        default_value = "cpu",
        value_delimiter = ','
    )]
    pub device: Vec<BenchDevice>,

    /// Weights and activations dtype: f32, f16, bf16, or int8 on the CPU (dense layers
    /// quantized dynamically; default: f32 on the CPU, f16 on a card).
    #[arg(long, env = "GPULANE_BENCH_DTYPE", value_parser = parse_dtype)]
    pub dtype: Option<BenchDtype>,

    /// Most texts per forward pass, as a comma list; one measurement per value. Each
    /// measurement's engine may also hold rows × the model's max_seq_length tokens.
    #[arg(
        long,
        env = "GPULANE_BENCH_BATCH_ROWS",
        default_value = "32",
        value_delimiter = ',',
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub batch_rows: Vec<u64>,

    /// How attention runs on a card, as a comma list (`varlen`, `padded`; see `gpulane
    /// run --gpu-attention`): one measurement per value on each card. The CPU in f32
    /// always runs its packed kernel, measured once.
    #[arg(
        long,
        env = "GPULANE_BENCH_ATTENTION",
        default_value = "varlen",
        value_delimiter = ','
    )]
    pub attention: Vec<gpulane_models::Attention>,

    /// Measured runs per (device, batch size); the median is reported.
    #[arg(long, env = "GPULANE_BENCH_REPEAT", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub repeat: u64,

    /// Unmeasured runs first, per (device, batch size): kernel compilation, allocator
    /// growth and caches settle here.
    #[arg(long, env = "GPULANE_BENCH_WARMUP", default_value_t = 1)]
    pub warmup: u64,

    /// Write the vectors of the first measured run as JSON lines, one `[floats]` per
    /// text in corpus order. With several devices or batch sizes, only the first
    /// measurement's vectors are written.
    #[arg(long)]
    pub dump: Option<PathBuf>,

    /// Write every measurement as JSON (model, gpulane_version, threads, results).
    #[arg(long)]
    pub json: Option<PathBuf>,

    /// Where models named by Hugging Face repo id come from.
    #[command(flatten)]
    pub hub: HubArgs,

    /// Path of the NVML library (default: the system's libnvidia-ml.so.1); read for
    /// `cuda:GPU-UUID` and `all`.
    #[arg(long, env = "GPULANE_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,

    /// Which CUDA cards this process may use, as CUDA reads it.
    #[arg(long, env = "CUDA_VISIBLE_DEVICES", hide = true)]
    pub cuda_visible_devices: Option<String>,

    /// The CPU's compute threads, as candle reads it (default: every core).
    #[arg(long, env = "RAYON_NUM_THREADS", hide = true)]
    pub rayon_num_threads: Option<usize>,
}

/// One `--device` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BenchDevice {
    /// The host CPU.
    Cpu,
    /// A card by CUDA ordinal (`cuda:N`).
    CudaOrdinal(usize),
    /// A card by NVML UUID or a unique prefix (`cuda:GPU-…`).
    CudaUuid(String),
    /// Every visible card, then the CPU.
    All,
}

impl std::str::FromStr for BenchDevice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        match s {
            "cpu" => return Ok(Self::Cpu),
            "all" => return Ok(Self::All),
            "cuda" => return Ok(Self::CudaOrdinal(0)),
            _ => {}
        }
        let Some(card) = s.strip_prefix("cuda:") else {
            return Err(format!("{s:?}: expected cpu, cuda:N, cuda:GPU-UUID or all"));
        };
        if let Ok(n) = card.parse::<usize>() {
            Ok(Self::CudaOrdinal(n))
        } else if card.len() > 4 && card[..4].eq_ignore_ascii_case("gpu-") {
            Ok(Self::CudaUuid(card.to_owned()))
        } else {
            Err(format!(
                "{s:?}: after cuda: put a CUDA ordinal (cuda:0) or a card UUID (cuda:GPU-…)"
            ))
        }
    }
}

/// What `gpulane bench` computes in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BenchDtype {
    /// Weights and activations in this float type.
    Float(DType),
    /// f32 with the dense layers in dynamic int8 (the CPU's `--cpu-dtype int8`).
    Int8,
}

fn parse_dtype(s: &str) -> Result<BenchDtype, String> {
    match s {
        "f32" => Ok(BenchDtype::Float(DType::F32)),
        "f16" => Ok(BenchDtype::Float(DType::F16)),
        "bf16" => Ok(BenchDtype::Float(DType::BF16)),
        "int8" => Ok(BenchDtype::Int8),
        other => Err(format!("{other:?}: use f32, f16, bf16 or int8")),
    }
}

/// A device to measure, resolved.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// `cpu` or `cuda:N`.
    pub(crate) label: String,
    pub(crate) engine: EngineDevice,
    /// The card, when the inventory knows it.
    gpu: Option<GpuDevice>,
}

/// Turns `--device` entries into devices, reading the inventory only when a card is named
/// by UUID or `all` is asked for. Cards need the `cuda` feature; no silent CPU fallback.
pub(crate) fn targets(
    wanted: &[BenchDevice],
    cards: impl FnOnce() -> Result<Vec<GpuDevice>, RuntimeError>,
    cuda_built: bool,
) -> Result<Vec<Target>, RuntimeError> {
    let needs_inventory = wanted
        .iter()
        .any(|d| matches!(d, BenchDevice::All | BenchDevice::CudaUuid(_)));
    let cards = if needs_inventory { cards()? } else { vec![] };
    let no_cuda = |what: &str| {
        RuntimeError::Config(format!(
            "--device {what}: this gpulane was built without the `cuda` feature; rebuild with \
             `--features cuda` (scripts/cuda-build.sh) or pass --device cpu"
        ))
    };
    let card_target = |g: &GpuDevice| Target {
        label: format!("cuda:{}", g.cuda_ordinal),
        engine: EngineDevice::Cuda(g.cuda_ordinal),
        gpu: Some(g.clone()),
    };
    let mut out: Vec<Target> = Vec::new();
    for d in wanted {
        match d {
            BenchDevice::Cpu => out.push(Target {
                label: "cpu".to_owned(),
                engine: EngineDevice::Cpu,
                gpu: None,
            }),
            BenchDevice::CudaOrdinal(n) => {
                if !cuda_built {
                    return Err(no_cuda(&format!("cuda:{n}")));
                }
                out.push(Target {
                    label: format!("cuda:{n}"),
                    engine: EngineDevice::Cuda(*n),
                    gpu: None,
                });
            }
            BenchDevice::CudaUuid(u) => {
                if !cuda_built {
                    return Err(no_cuda(&format!("cuda:{u}")));
                }
                // The same matching CUDA_VISIBLE_DEVICES does: a unique prefix, with or
                // without `GPU-`, case-insensitive.
                let found = crate::devices::filter_visible(&cards, Some(u));
                let g = found.first().ok_or_else(|| {
                    RuntimeError::Config(format!(
                        "--device cuda:{u}: no visible card has that UUID (visible: {:?})",
                        cards.iter().map(|c| c.uuid.as_str()).collect::<Vec<_>>()
                    ))
                })?;
                let g = cards
                    .iter()
                    .find(|c| c.uuid == g.uuid)
                    .expect("filter_visible returns cards of its input; this is a bug");
                out.push(card_target(g));
            }
            BenchDevice::All => {
                if !cards.is_empty() && !cuda_built {
                    return Err(no_cuda("all"));
                }
                out.extend(cards.iter().map(card_target));
                out.push(Target {
                    label: "cpu".to_owned(),
                    engine: EngineDevice::Cpu,
                    gpu: None,
                });
            }
        }
    }
    // `all,cpu` and the like: measure each device once.
    let mut unique: Vec<Target> = Vec::new();
    for t in out {
        if !unique.iter().any(|u| u.label == t.label) {
            unique.push(t);
        }
    }
    Ok(unique)
}

/// The texts of a corpus file: one per line, blank lines skipped.
fn read_corpus(path: &Path) -> Result<Vec<String>, RuntimeError> {
    let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::File {
        path: path.to_owned(),
        source,
    })?;
    let texts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    if texts.is_empty() {
        return Err(RuntimeError::Config(format!(
            "--corpus {}: no text in it (one text per line)",
            path.display()
        )));
    }
    Ok(texts)
}

fn median(seconds: &[f64]) -> f64 {
    let mut s = seconds.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// One (device, dtype, batch size) measurement.
#[derive(Debug, Clone, Serialize)]
struct Measurement {
    device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_name: Option<String>,
    dtype: &'static str,
    /// `packed` (the CPU), or the card's `varlen` / `padded`.
    attention: &'static str,
    batch_rows: usize,
    texts: usize,
    tokens: usize,
    seconds: Vec<f64>,
    seconds_median: f64,
    texts_per_s: f64,
    tokens_per_s: f64,
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    model: &'a str,
    model_path: String,
    gpulane_version: &'static str,
    threads: usize,
    /// The widest vector extension gpulane's CPU kernels used (`--cpu-isa`, capped).
    cpu_isa: &'static str,
    results: &'a [Measurement],
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), RuntimeError> {
    std::fs::write(path, bytes).map_err(|source| RuntimeError::Write {
        path: path.to_owned(),
        source,
    })
}

fn dump_vectors(path: &Path, vectors: &[Vec<f32>]) -> Result<(), RuntimeError> {
    let mut out = Vec::with_capacity(vectors.len() * vectors.first().map_or(0, |v| v.len()) * 12);
    for v in vectors {
        serde_json::to_writer(&mut out, v).expect("floats always serialise; this is a bug");
        out.push(b'\n');
    }
    write_file(path, &out)
}

/// Runs `gpulane bench`.
pub(crate) async fn run_bench(args: BenchArgs) -> Result<(), RuntimeError> {
    let texts = read_corpus(&args.corpus)?;
    let device_args = DeviceArgs {
        simulate_gpus: None,
        gpus: "all".to_owned(),
        cpu_lane: crate::config::CpuLane::Auto,
        host: None,
        nvml_lib: args.nvml_lib.clone(),
        simulated_memory: None,
        simulated_host_memory: None,
        simulated_id: None,
        cuda_visible_devices: args.cuda_visible_devices.clone(),
    };
    let targets = targets(
        &args.device,
        || {
            Ok(inventory(&DeviceSettings::from_args(&device_args)?)?
                .devices()
                .to_vec())
        },
        cfg!(feature = "cuda"),
    )?;
    let spec = resolve_models(
        &ModelArgs {
            models: vec![args.model.clone()],
            models_file: None,
            // `--dtype` chooses, per measurement.
            cpu_dtype: "f32".to_owned(),
            hub: args.hub.clone(),
        },
        false,
    )
    .await?
    .into_iter()
    .next()
    .expect("one declaration resolves to one model; this is a bug");
    let info = SentenceTransformerDir::open(&spec.path)
        .map_err(|source| RuntimeError::Model {
            name: spec.name.clone(),
            device: "-".to_owned(),
            source: Box::new(source),
        })?
        .info;
    let threads = args
        .rayon_num_threads
        .filter(|n| *n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
    tracing::info!(model = %spec.name, path = %spec.path.display(), texts = texts.len(),
        devices = ?targets.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(),
        batch_rows = ?args.batch_rows, repeat = args.repeat, warmup = args.warmup, threads,
        cpu_isa = gpulane_models::cpu_isa().as_str(),
        "benchmark");

    let mut results: Vec<Measurement> = Vec::new();
    let mut dumped = args.dump.is_none();
    for t in &targets {
        if let Some(g) = &t.gpu {
            crate::devices::check_cuda_ordinal(g)?;
        }
        let (dtype, int8) = match args.dtype {
            Some(BenchDtype::Float(d)) => (d, false),
            Some(BenchDtype::Int8) => (DType::F32, true),
            None => match t.engine {
                EngineDevice::Cpu => (DType::F32, false),
                EngineDevice::Cuda(_) => (DType::F16, false),
            },
        };
        // The CPU has one route; a card one per `--attention` value.
        let routes: Vec<Option<gpulane_models::Attention>> = match t.engine {
            EngineDevice::Cpu => vec![None],
            EngineDevice::Cuda(_) => args.attention.iter().copied().map(Some).collect(),
        };
        for (&rows, route) in args
            .batch_rows
            .iter()
            .flat_map(|r| routes.iter().map(move |a| (r, a)))
        {
            let rows = rows as usize;
            let opts = EngineOptions {
                dtype,
                int8,
                attention: route.unwrap_or_default(),
                batch_rows: Some(rows),
                batch_tokens: Some(rows.saturating_mul(info.max_seq_length)),
                // One caller: nothing else can join a batch, so never wait for one.
                batch_wait: Duration::ZERO,
                ..EngineOptions::default()
            };
            let engine =
                Engine::start(&spec.name, &spec.path, &t.engine, opts).map_err(|source| {
                    RuntimeError::Model {
                        name: spec.name.clone(),
                        device: t.label.clone(),
                        source: Box::new(source),
                    }
                })?;
            let failed = |source: gpulane_models::ModelError| RuntimeError::Model {
                name: spec.name.clone(),
                device: t.label.clone(),
                source: Box::new(source),
            };
            for _ in 0..args.warmup {
                engine
                    .embed(texts.clone(), EmbedOptions::default(), &Default::default())
                    .await
                    .map_err(failed)?;
            }
            let mut seconds = Vec::with_capacity(args.repeat as usize);
            let mut tokens = 0;
            for run in 0..args.repeat {
                let input = texts.clone();
                let start = Instant::now();
                let out = engine
                    .embed(input, EmbedOptions::default(), &Default::default())
                    .await
                    .map_err(failed)?;
                seconds.push(start.elapsed().as_secs_f64());
                tokens = out.token_counts.iter().sum();
                if run == 0 && !dumped {
                    let path = args.dump.as_ref().expect("checked by `dumped`");
                    dump_vectors(path, &out.vectors)?;
                    dumped = true;
                }
            }
            drop(engine);
            let med = median(&seconds);
            let m = Measurement {
                device: t.label.clone(),
                gpu_uuid: t.gpu.as_ref().map(|g| g.uuid.clone()),
                gpu_name: t.gpu.as_ref().map(|g| g.name.clone()),
                dtype: if int8 { "int8" } else { dtype.as_str() },
                attention: route.map_or("packed", |a| a.as_str()),
                batch_rows: rows,
                texts: texts.len(),
                tokens,
                seconds,
                seconds_median: med,
                texts_per_s: texts.len() as f64 / med,
                tokens_per_s: tokens as f64 / med,
            };
            tracing::info!(device = %m.device, dtype = m.dtype, attention = m.attention, batch_rows = rows,
                seconds = med, tokens_per_s = m.tokens_per_s, "measured");
            results.push(m);
        }
    }

    println!(
        "{:<10} {:<5} {:<9} {:>10} {:>7} {:>9} {:>10} {:>10} {:>11}",
        "device",
        "dtype",
        "attention",
        "batch_rows",
        "texts",
        "tokens",
        "median_s",
        "texts/s",
        "tokens/s"
    );
    for m in &results {
        println!(
            "{:<10} {:<5} {:<9} {:>10} {:>7} {:>9} {:>10.4} {:>10.1} {:>11.1}",
            m.device,
            m.dtype,
            m.attention,
            m.batch_rows,
            m.texts,
            m.tokens,
            m.seconds_median,
            m.texts_per_s,
            m.tokens_per_s
        );
    }
    if let Some(path) = &args.json {
        let report = Report {
            model: &spec.name,
            model_path: spec.path.display().to_string(),
            gpulane_version: env!("CARGO_PKG_VERSION"),
            threads,
            cpu_isa: gpulane_models::cpu_isa().as_str(),
            results: &results,
        };
        let mut bytes = serde_json::to_vec_pretty(&report)
            .expect("the report always serialises; this is a bug");
        bytes.push(b'\n');
        write_file(path, &bytes)?;
    }
    if let Some(path) = &args.dump {
        tracing::info!(path = %path.display(), "vectors of the first measured run written");
    }
    std::io::stdout().flush().ok();
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::{Cli, Command};

    fn bench(extra: &[&str]) -> BenchArgs {
        let mut argv = vec!["gpulane", "bench", "--model", "/m", "--corpus", "/c"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Bench(a) => *a,
            _ => unreachable!(),
        }
    }

    fn card(index: u32, uuid: &str) -> GpuDevice {
        GpuDevice {
            uuid: uuid.to_owned(),
            index,
            cuda_ordinal: index as usize,
            name: "card".into(),
            total_memory: 1 << 30,
            simulated: false,
        }
    }

    #[test]
    fn defaults_are_one_cpu_measurement() {
        let a = bench(&[]);
        assert_eq!(a.device, vec![BenchDevice::Cpu]);
        assert_eq!(a.batch_rows, vec![32]);
        assert_eq!((a.repeat, a.warmup), (5, 1));
        assert_eq!(a.dtype, None);
    }

    #[test]
    fn batch_rows_is_a_list_of_positive_integers() {
        assert_eq!(
            bench(&["--batch-rows", "8,32,128"]).batch_rows,
            vec![8, 32, 128]
        );
        let parse = |v: &str| {
            Cli::try_parse_from([
                "gpulane",
                "bench",
                "--model",
                "m",
                "--corpus",
                "c",
                "--batch-rows",
                v,
            ])
        };
        assert!(parse("0").is_err());
        assert!(parse("8,x").is_err());
    }

    #[test]
    fn devices_and_dtypes_parse() {
        let a = bench(&["--device", "cpu,cuda:1,cuda:GPU-ab12", "--dtype", "bf16"]);
        assert_eq!(
            a.device,
            vec![
                BenchDevice::Cpu,
                BenchDevice::CudaOrdinal(1),
                BenchDevice::CudaUuid("GPU-ab12".into())
            ]
        );
        assert_eq!(a.dtype, Some(BenchDtype::Float(DType::BF16)));
        assert_eq!(parse_dtype("int8"), Ok(BenchDtype::Int8));
        for bad in ["gpu0", "cuda:", "cuda:x", "cuda:-1"] {
            assert!(bad.parse::<BenchDevice>().is_err(), "{bad}");
        }
        assert!(parse_dtype("f64").is_err());
    }

    #[test]
    fn attention_routes_are_a_list_defaulting_to_varlen() {
        use gpulane_models::Attention;
        assert_eq!(bench(&[]).attention, vec![Attention::Varlen]);
        let a = bench(&["--attention", "varlen,padded"]);
        assert_eq!(a.attention, vec![Attention::Varlen, Attention::Padded]);
    }

    #[test]
    fn cards_need_the_cuda_feature() {
        let none = || -> Result<Vec<GpuDevice>, RuntimeError> { Ok(vec![card(0, "GPU-a")]) };
        let e = targets(&[BenchDevice::CudaOrdinal(0)], none, false).unwrap_err();
        assert!(e.to_string().contains("--features cuda"), "{e}");
        assert!(targets(&[BenchDevice::All], none, false).is_err());
        // `all` on a machine without cards is just the CPU, built either way.
        let empty = || Ok(vec![]);
        let t = targets(&[BenchDevice::All], empty, false).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].label, "cpu");
    }

    #[test]
    fn a_uuid_selects_its_cards_cuda_ordinal() {
        // CUDA_VISIBLE_DEVICES=2,0 made card 2 ordinal 0 and card 0 ordinal 1.
        let cards = || {
            Ok(vec![
                GpuDevice {
                    cuda_ordinal: 0,
                    ..card(2, "GPU-cccc-2")
                },
                GpuDevice {
                    cuda_ordinal: 1,
                    ..card(0, "GPU-aaaa-0")
                },
            ])
        };
        let t = targets(&[BenchDevice::CudaUuid("GPU-aaaa".into())], cards, true).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].label, "cuda:1");
        assert!(matches!(t[0].engine, EngineDevice::Cuda(1)));
        let all = targets(&[BenchDevice::All, BenchDevice::Cpu], cards, true).unwrap();
        let labels: Vec<&str> = all.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(labels, ["cuda:0", "cuda:1", "cpu"]);
        assert!(targets(&[BenchDevice::CudaUuid("GPU-ffff".into())], cards, true).is_err());
    }

    #[test]
    fn corpus_skips_blank_lines_and_median_is_the_middle() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.txt");
        std::fs::write(&f, "one\n\n  \ntwo\r\nthree").unwrap();
        assert_eq!(read_corpus(&f).unwrap(), ["one", "two", "three"]);
        std::fs::write(&f, "\n\n").unwrap();
        assert!(read_corpus(&f).is_err());
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
