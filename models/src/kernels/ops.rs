//! The fused element-wise steps as candle custom ops: gpulane's CPU kernels for
//! contiguous f32, its CUDA kernels on cards, candle's ops elsewhere.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use rayon::prelude::*;

use super::{
    packed::Heads,
    read::{cpu_f32, f32_slice, CpuF32},
    rows::{
        add_norm_row, bias_gelu_row, gated_gelu_row, gated_silu_row, qk_norm_rope_row, rope_row,
    },
    ROWS_PER_TASK,
};

struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "gpulane-bias-gelu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "bias-gelu x")?;
        let bias = f32_slice(s2, l2, "bias-gelu bias")?;
        let h = bias.len();
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .for_each(|(o, x)| {
                for (o, x) in o.chunks_mut(h).zip(x.chunks(h)) {
                    bias_gelu_row(x, bias, o);
                }
            });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            crate::cuda::bias_gelu((s1, l1), (s2, l2))?,
            l1.shape().clone(),
        ))
    }
}

struct GatedGelu;

impl CustomOp1 for GatedGelu {
    fn name(&self) -> &'static str {
        "gpulane-gated-gelu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "gated-gelu x")?;
        let (n, two_i) = l1.shape().dims2()?;
        Ok((
            CpuStorage::F32(gated_rows(x, two_i, gated_gelu_row)),
            Shape::from((n, two_i / 2)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, two_i) = l1.shape().dims2()?;
        Ok((
            crate::cuda::gated_gelu((s1, l1))?,
            Shape::from((n, two_i / 2)),
        ))
    }
}

struct AddNorm {
    eps: f32,
}

impl CustomOp3 for AddNorm {
    fn name(&self) -> &'static str {
        "gpulane-add-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "add-norm x")?;
        let res = f32_slice(s2, l2, "add-norm residual")?;
        let params = f32_slice(s3, l3, "add-norm params")?;
        let h = params.len() / 3;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(h * ROWS_PER_TASK)
            .zip(x.par_chunks(h * ROWS_PER_TASK))
            .zip(res.par_chunks(h * ROWS_PER_TASK))
            .for_each(|((o, x), r)| {
                for ((o, x), r) in o.chunks_mut(h).zip(x.chunks(h)).zip(r.chunks(h)) {
                    add_norm_row(x, r, params, self.eps, o);
                }
            });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::cuda::add_norm((s1, l1), (s2, l2), (s3, l3), self.eps)?;
        Ok((out, l1.shape().clone()))
    }
}

/// Which element-wise kernels a card runs: gpulane's own (`models/cuda/kernels.cu`, with
/// the varlen route), or candle's ops (with `--gpu-attention padded`, the whole route as
/// it was before gpulane's CUDA kernels, to compare with and to fall back on). The CPU
/// runs its own fused kernels in f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CardOps {
    Gpulane,
    Candle,
}

/// Whether the fused kernels (`bias_gelu`, `gated_gelu`, `add_norm`) run for this
/// tensor: gpulane's CPU ones in f32, its CUDA ones in f32, f16 and bf16 unless `ops`
/// says candle's.
fn fused(t: &Tensor, ops: CardOps) -> bool {
    cpu_f32(t)
        || (t.is_contiguous()
            && t.device().is_cuda()
            && cfg!(feature = "cuda")
            && ops == CardOps::Gpulane
            && matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16))
}

/// GELU (erf) of `x + bias`, `bias` broadcast over the last dimension.
pub(crate) fn bias_gelu(x: &Tensor, bias: &Tensor, ops: CardOps) -> Result<Tensor> {
    if fused(x, ops) && fused(bias, ops) {
        x.apply_op2_no_bwd(bias, &BiasGelu)
    } else {
        x.broadcast_add(bias)?.gelu_erf()
    }
}

/// GELU (erf) of the first half of `x`'s last dimension times its second half: `[N, 2I]`
/// in, `[N, I]` out.
pub(crate) fn gated_gelu(x: &Tensor, ops: CardOps) -> Result<Tensor> {
    if fused(x, ops) {
        x.apply_op1_no_bwd(&GatedGelu)
    } else {
        let i = x.dim(candle_core::D::Minus1)? / 2;
        x.narrow(candle_core::D::Minus1, 0, i)?.gelu_erf()?
            * x.narrow(candle_core::D::Minus1, i, i)?
    }
}

/// SiLU of the first half of `x`'s last dimension times its second half: `[N, 2I]` in,
/// `[N, I]` out, on the CPU in f32 only (callers check [`cpu_f32`]; candle's SiLU calls
/// scalar `exp` on one strided half, then multiplies by the other: 15% of a Qwen3 int8
/// forward pass).
pub(crate) fn gated_silu(x: &Tensor) -> Result<Tensor> {
    let (n, two_i) = x.dims2()?;
    let out = gated_rows(
        CpuF32::read(x, "gated-silu x")?.values(),
        two_i,
        gated_silu_row,
    );
    Tensor::from_vec(out, (n, two_i / 2), x.device())
}

/// `row(x, out)` over every `two_i`-wide row of a gated up-projection, in parallel:
/// `[N, 2I]` in, `[N, I]` out.
pub(crate) fn gated_rows(x: &[f32], two_i: usize, row: fn(&[f32], &mut [f32])) -> Vec<f32> {
    let i = two_i / 2;
    let mut out = vec![0f32; x.len() / 2];
    out.par_chunks_mut(i * ROWS_PER_TASK)
        .zip(x.par_chunks(two_i * ROWS_PER_TASK))
        .for_each(|(o, x)| {
            for (o, x) in o.chunks_mut(i).zip(x.chunks(two_i)) {
                row(x, o);
            }
        });
    out
}

/// Per-head RMSNorm of Q (weight `q_norm`, `[d]`) and K (`k_norm`), then rotary
/// rotate-half by each token's angles (`cos`, `sin`: `N × d/2` values, read once per
/// batch by the caller, not once per layer), on a packed `[N, (q + 2·kv)·d]` `qkv`; V
/// passes through. One pass over a copy of `qkv`, on the CPU in f32 only (callers check
/// [`cpu_f32`]): the candle chain it replaces (narrow, copy, norm, concatenate, copy,
/// rotate, concatenate) was a quarter of a Qwen3 int8 pass.
pub(crate) fn qk_norm_rope(
    qkv: &Tensor,
    q_norm: &Tensor,
    k_norm: &Tensor,
    cos: &[f32],
    sin: &[f32],
    heads: Heads,
    eps: f32,
) -> Result<Tensor> {
    if q_norm.elem_count() != heads.d || k_norm.elem_count() != heads.d {
        candle_core::bail!("qk-norm-rope: norms of {heads:?} are not [d]");
    }
    // The norms' weights read in place, like every other weight of the fused CPU paths.
    let (qw, kw) = (
        CpuF32::read(q_norm, "q norm")?,
        CpuF32::read(k_norm, "k norm")?,
    );
    let (qw, kw) = (qw.values(), kw.values());
    rows_with_angles(qkv, cos, sin, heads, |row, c, s| {
        qk_norm_rope_row(row, qw, kw, c, s, heads, eps)
    })
}

/// Q and K of a packed `[N, (q + 2·kv)·d]` `qkv` rotated rotate-half style by each
/// token's angles (`cos`, `sin`: `N × d/2` values); V passes through. One pass over a copy
/// of `qkv`, on the CPU in f32 only (callers check [`cpu_f32`]), with the bits of the
/// candle chain cards run, which copies Q and K out, rotates them in a scalar loop that
/// strides over heads, and concatenates them back with V (three passes; 2-4% of a
/// ModernBERT-mini pass over long passages by a profile).
pub(crate) fn rope(qkv: &Tensor, cos: &[f32], sin: &[f32], heads: Heads) -> Result<Tensor> {
    rows_with_angles(qkv, cos, sin, heads, |row, c, s| rope_row(row, c, s, heads))
}

/// `row(token's row, its cos, its sin)` on each row of a copy of `qkv`, tasks of
/// [`ROWS_PER_TASK`] rows in parallel, after checking that `qkv` is `heads`' packed rows
/// and that the angles cover every token.
fn rows_with_angles(
    qkv: &Tensor,
    cos: &[f32],
    sin: &[f32],
    heads: Heads,
    row: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) -> Result<Tensor> {
    let (n, width) = qkv.dims2()?;
    if width != heads.qkv_width() || !heads.d.is_multiple_of(2) {
        candle_core::bail!("rope: qkv [{n}, {width}] does not fit {heads:?}");
    }
    let half = heads.d / 2;
    if cos.len() != n * half || sin.len() != n * half {
        candle_core::bail!("rope: angles for {} tokens, not {n}", cos.len() / half);
    }
    let mut out = CpuF32::read(qkv, "rope qkv")?.values().to_vec();
    out.par_chunks_mut(width * ROWS_PER_TASK)
        .zip(cos.par_chunks(half * ROWS_PER_TASK))
        .zip(sin.par_chunks(half * ROWS_PER_TASK))
        .for_each(|((o, c), s)| {
            for ((r, c), s) in o.chunks_mut(width).zip(c.chunks(half)).zip(s.chunks(half)) {
                row(r, c, s);
            }
        });
    Tensor::from_vec(out, (n, width), qkv.device())
}

/// LayerNorm(x + bias + residual) with `params` = [bias; gamma; beta] as one `[3, H]`
/// tensor (one operand instead of three).
pub(crate) fn add_norm(
    x: &Tensor,
    residual: &Tensor,
    params: &Tensor,
    eps: f32,
    ops: CardOps,
) -> Result<Tensor> {
    if fused(x, ops) && fused(residual, ops) && fused(params, ops) {
        x.apply_op3_no_bwd(residual, params, &AddNorm { eps })
    } else {
        let (bias, gamma, beta) = (params.get(0)?, params.get(1)?, params.get(2)?);
        let sum = (x.broadcast_add(&bias)? + residual)?;
        candle_nn::ops::layer_norm(&sum, &gamma, &beta, eps)
    }
}
