//! A self-check of gpulane's own kernels on a device: each op on random inputs, in every
//! dtype the device runs, against the CPU kernels in f32 on the same (dtype-rounded)
//! inputs. `gpulane kernel-check` prints it; `scripts/gpu-check.sh` runs it first on a
//! card, so one run there covers what a MiniLM embedding does not reach (bf16, heads of 8
//! to 256 dims, grouped-query heads, windows, causal masks, the relative bias, the gated
//! GELU). On the CPU it checks the varlen route's Rust twin the same way.
//!
//! The shapes are those of the emulated tests (`simt_tests.rs`), which check the same
//! kernel bodies on the CPU in f32; what this adds is the card itself: the driver's
//! compile of the PTX, 16-bit storage, and real warps.

use candle_core::{DType, Device, Tensor};

use crate::{
    kernels::{self, CardOps, Heads, Mask, Products, RelativeBias},
    varlen::{row_starts, Varlen},
    ModelError,
};

/// One op, case and dtype: the largest difference from the reference, and the bound.
#[derive(Debug, Clone)]
pub struct KernelCheck {
    /// `varlen_attention`, `add_norm`, `bias_gelu` or `gated_gelu`.
    pub op: &'static str,
    /// The shape and mask.
    pub case: String,
    /// The dtype the op ran in on the device.
    pub dtype: DType,
    /// The largest |device − reference| over the output (NaN if any output was NaN).
    pub max_abs_diff: f32,
    /// The largest |device − reference| / max(1, |reference|): absolute for outputs
    /// within ±1, relative beyond, since a dtype's rounding grows with the magnitude.
    pub max_scaled_diff: f32,
    /// What rounding the output to `dtype` allows, on the scaled difference.
    pub bound: f32,
}

impl KernelCheck {
    /// Within its bound (a NaN never is).
    pub fn ok(&self) -> bool {
        self.max_scaled_diff <= self.bound
    }

    /// `got` (any device, any dtype) against the CPU reference `want`, bounded for `dtype`.
    fn of(
        op: &'static str,
        case: String,
        dtype: DType,
        want: &Tensor,
        got: &Tensor,
    ) -> Result<Self, ModelError> {
        let (max_abs_diff, max_scaled_diff) = tensor_diff(want, got)?;
        Ok(Self {
            op,
            case,
            dtype,
            max_abs_diff,
            max_scaled_diff,
            bound: bound(dtype),
        })
    }
}

/// Rows of mixed lengths, one of a single token (also the emulated tests' batch).
pub(crate) const LENS: [usize; 5] = [5, 1, 13, 3, 9];

/// Heads of every lane split the attention kernel has: 1, 2, 4 and 8 dims a lane, some
/// lanes idle (8, 40, 72, 160), grouped-query heads among them (also the emulated tests').
pub(crate) const HEADS: [Heads; 7] = [
    Heads { q: 2, kv: 2, d: 8 },
    Heads { q: 3, kv: 1, d: 32 },
    Heads { q: 4, kv: 2, d: 40 },
    Heads { q: 1, kv: 1, d: 72 },
    Heads {
        q: 2,
        kv: 1,
        d: 128,
    },
    Heads {
        q: 2,
        kv: 1,
        d: 160,
    },
    Heads {
        q: 1,
        kv: 1,
        d: 256,
    },
];

/// One attention case's inputs for [`LENS`]: packed `qkv` (f32 on the CPU, rounded to
/// `dtype`) with scores of unit scale, as a model's (its Q carries 1/√d: raw N(0, 1)
/// inputs give a 256-dim head scores of ±50, where any two summation orders differ by
/// more than rounding through the softmax), and a relative bias over the rows, its table
/// on `device`.
pub(crate) fn attention_inputs(
    heads: Heads,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, RelativeBias), ModelError> {
    let n: usize = LENS.iter().sum();
    let span = *LENS.iter().max().expect("rows");
    let qkv = rounded(&[n, heads.qkv_width()], (heads.d as f32).powf(-0.25), dtype)?;
    let table = rounded(&[heads.q * (2 * span - 1)], 1.0, DType::F32)?;
    let relative = RelativeBias {
        span,
        table: table.to_vec1()?,
        on_device: Some(table.to_device(device)?),
        padded: None,
    };
    Ok((qkv, relative))
}

/// Every mask, by name.
pub(crate) fn masks(relative: &RelativeBias) -> [(&'static str, Mask<'_>); 4] {
    [
        ("full", Mask::Full),
        ("window 2", Mask::Window(2)),
        ("causal", Mask::Causal),
        ("relative", Mask::Relative(relative)),
    ]
}

/// The largest |a − b|, NaN if any element is NaN or the lengths differ (so an output
/// left unwritten, or NaN, fails every bound).
pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    max_diff(a, b, |d, _| d)
}

/// [`max_abs_diff`] with each difference divided by max(1, |reference|), NaN as there.
fn max_scaled_diff(want: &[f32], got: &[f32]) -> f32 {
    max_diff(want, got, |d, w| d / w.abs().max(1.0))
}

/// The largest `scale(|a − b|, a)`, NaN if any is NaN or the lengths differ.
fn max_diff(a: &[f32], b: &[f32], scale: impl Fn(f32, f32) -> f32) -> f32 {
    if a.len() != b.len() {
        return f32::NAN;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| scale((x - y).abs(), *x))
        .fold(0.0, |m, d| {
            if m.is_nan() || d.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// Bounds on the scaled difference: one rounding of the output to the dtype (a relative
/// 2⁻¹¹ in f16, 2⁻⁸ in bf16) plus accumulation order stays far under these, while a wrong
/// index or reduction is off by O(1). An absolute bound was wrong for the gated GELU,
/// whose products of two N(0, 4) halves reach ±30: on an H200 its bf16 output was off by
/// up to 0.0605, what one rounding of a value in [16, 32) (steps of 0.125) gives, and
/// failed the absolute 0.06 (2026-12-04, 47133226).
fn bound(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 1e-2,
        DType::BF16 => 6e-2,
        _ => 1e-4,
    }
}

/// The dtypes `device` runs gpulane's kernels in.
fn dtypes(device: &Device) -> Vec<DType> {
    if device.is_cuda() {
        vec![DType::F32, DType::F16, DType::BF16]
    } else {
        vec![DType::F32]
    }
}

/// N(0, scale²) values as `dtype` would store them, in f32 on the CPU.
fn rounded(shape: &[usize], scale: f32, dtype: DType) -> Result<Tensor, ModelError> {
    let t = (Tensor::randn(0f32, 1f32, shape, &Device::Cpu)? * scale as f64)?;
    Ok(t.to_dtype(dtype)?.to_dtype(DType::F32)?)
}

/// The absolute and the scaled difference of `got` (any device, any dtype) from `want`.
fn tensor_diff(want: &Tensor, got: &Tensor) -> Result<(f32, f32), ModelError> {
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let (want, got) = (
        want.flatten_all()?.to_vec1::<f32>()?,
        got.flatten_all()?.to_vec1::<f32>()?,
    );
    Ok((max_abs_diff(&want, &got), max_scaled_diff(&want, &got)))
}

/// Every check on `device`.
pub fn check_kernels(device: &Device) -> Result<Vec<KernelCheck>, ModelError> {
    let mut out = Vec::new();
    for dtype in dtypes(device) {
        attention_checks(device, dtype, &mut out)?;
        row_checks(device, dtype, &mut out)?;
    }
    Ok(out)
}

fn attention_checks(
    device: &Device,
    dtype: DType,
    out: &mut Vec<KernelCheck>,
) -> Result<(), ModelError> {
    let starts = row_starts(&LENS);
    let varlen = Varlen::new(&starts, &LENS, device)?;
    for heads in HEADS {
        let (qkv, relative) = attention_inputs(heads, dtype, device)?;
        let on_device = qkv.to_dtype(dtype)?.to_device(device)?;
        for (name, mask) in masks(&relative) {
            let want = kernels::attention(&qkv, &starts, &LENS, heads, mask, Products::F32)?;
            let got = varlen.attend(&on_device, (&starts, &LENS), heads, mask)?;
            let case = format!("q{} kv{} d{}, {name}", heads.q, heads.kv, heads.d);
            out.push(KernelCheck::of(
                "varlen_attention",
                case,
                dtype,
                &want,
                &got,
            )?);
        }
    }
    Ok(())
}

fn row_checks(device: &Device, dtype: DType, out: &mut Vec<KernelCheck>) -> Result<(), ModelError> {
    // 40 and 384 wide: a width that is not a multiple of a warp, and MiniLM's.
    for (rows, h) in [(9usize, 40usize), (33, 384)] {
        let x = rounded(&[rows, h], 2.0, dtype)?;
        let res = rounded(&[rows, h], 2.0, dtype)?;
        let bias = rounded(&[h], 0.5, dtype)?;
        let gamma = (rounded(&[h], 0.5, dtype)? + 1.0)?
            .to_dtype(dtype)?
            .to_dtype(DType::F32)?;
        let beta = rounded(&[h], 0.5, dtype)?;
        let params = Tensor::stack(&[&bias, &gamma, &beta], 0)?;
        let dev = |t: &Tensor| -> Result<Tensor, ModelError> {
            Ok(t.to_dtype(dtype)?.to_device(device)?)
        };
        let eps = 1e-12;
        let case = format!("{rows} × {h}");
        let ops = CardOps::Gpulane;
        let pairs = [
            (
                "add_norm",
                kernels::add_norm(&x, &res, &params, eps, ops)?,
                kernels::add_norm(&dev(&x)?, &dev(&res)?, &dev(&params)?, eps, ops)?,
            ),
            (
                "bias_gelu",
                kernels::bias_gelu(&x, &bias, ops)?,
                kernels::bias_gelu(&dev(&x)?, &dev(&bias)?, ops)?,
            ),
            (
                "gated_gelu",
                kernels::gated_gelu(&x, ops)?,
                kernels::gated_gelu(&dev(&x)?, ops)?,
            ),
        ];
        for (op, want, got) in pairs {
            out.push(KernelCheck::of(op, case.clone(), dtype, &want, &got)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the check runs the varlen route's Rust twin against the packed kernel
    /// (and the row kernels against themselves): every case is there and within bounds.
    #[test]
    fn the_kernel_check_runs_on_the_cpu_and_passes() {
        let checks = check_kernels(&Device::Cpu).unwrap();
        assert_eq!(checks.len(), HEADS.len() * 4 + 2 * 3, "{checks:?}");
        for c in &checks {
            assert!(c.ok(), "{c:?}");
        }
        let failed = KernelCheck {
            max_scaled_diff: f32::NAN,
            ..checks[0].clone()
        };
        assert!(!failed.ok(), "a NaN output fails");
    }

    /// Below 1 the difference is absolute, above it relative; NaN and a short output fail.
    #[test]
    fn the_scaled_difference_is_relative_only_beyond_one() {
        let d = max_scaled_diff(&[0.5, 16.0, -32.0], &[0.5, 16.0625, -31.0]);
        assert!((d - 1.0 / 32.0).abs() < 1e-7, "{d}");
        let d = max_scaled_diff(&[0.5, 16.0], &[0.6, 16.0]);
        assert!((d - 0.1).abs() < 1e-6, "{d}");
        assert!(max_scaled_diff(&[1.0, 2.0], &[1.0, f32::NAN]).is_nan());
        assert!(max_scaled_diff(&[1.0, 2.0], &[1.0]).is_nan());
    }
}
