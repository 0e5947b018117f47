//! Rotary position embeddings (ModernBERT, Qwen3), rotate-half style as transformers'
//! `apply_rotary_pos_emb`.

use candle_core::{DType, Device, Tensor};

use super::layers::RmsNorm;
use crate::{
    kernels::{self, CpuF32, Heads},
    ModelError,
};

/// cos and sin of every position's rotation angles, `[positions, d/2]`, in f32: Q and K
/// are rotated in f32 whatever the model's dtype, as transformers does.
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// The angles transformers computes: `inv_freq = 1 / theta^(2k/d)` and
    /// `angle = position · inv_freq`, both in f32 as there (at position 8000 an f64 angle
    /// would differ from the reference by ~1e-3 rad), then cos and sin of that f32 angle.
    pub(crate) fn new(
        theta: f64,
        d: usize,
        positions: usize,
        dev: &Device,
    ) -> Result<Self, ModelError> {
        let half = d / 2;
        let inv: Vec<f32> = (0..half)
            .map(|k| 1.0 / (theta as f32).powf((2 * k) as f32 / d as f32))
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv {
                let angle = (p as f32 * f) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (positions, half), dev)?,
            sin: Tensor::from_vec(sin, (positions, half), dev)?,
        })
    }

    /// Each packed token's cos and sin, `[N, 1, d/2]`: one "batch" per token, so candle's
    /// rotary kernel spreads tokens over threads and each gets its own position.
    pub(crate) fn at(&self, pos: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let n = pos.dim(0)?;
        let half = self.cos.dim(1)?;
        Ok((
            self.cos.index_select(pos, 0)?.reshape((n, 1, half))?,
            self.sin.index_select(pos, 0)?.reshape((n, 1, half))?,
        ))
    }
}

/// Rotates Q and K of packed `qkv` (`[N, (q + 2·kv)·d]`) by each token's angles (`[N, 1,
/// d/2]`, f32), rotate-half style, in f32 and rounded back to `qkv`'s dtype once, as
/// transformers does; V passes through. On the CPU in f32 it is one pass
/// (`kernels::rope`); elsewhere candle's ops, with the same bits.
pub(crate) fn rotate(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: Heads,
) -> Result<Tensor, ModelError> {
    if [qkv, cos, sin].into_iter().all(kernels::cpu_f32) {
        let (c, s) = read_angles(cos, sin)?;
        return Ok(kernels::rope(qkv, c.values(), s.values(), heads)?);
    }
    rotate_by_ops(qkv, cos, sin, heads)
}

/// Each token's `cos` and `sin` read in place, for the fused CPU rotations.
pub(super) fn read_angles<'a>(
    cos: &'a Tensor,
    sin: &'a Tensor,
) -> candle_core::Result<(CpuF32<'a>, CpuF32<'a>)> {
    Ok((
        CpuF32::read(cos, "rope cos")?,
        CpuF32::read(sin, "rope sin")?,
    ))
}

/// Qwen3's: each Q head RMS-normalized with `q_norm`'s weight and each K head with
/// `k_norm`'s, over its d values, then [`rotate`]d. On the CPU in f32 one pass
/// (`kernels::qk_norm_rope`); elsewhere candle's ops.
pub(crate) fn rotate_qk_normed(
    qkv: &Tensor,
    (q_norm, k_norm): (&RmsNorm, &RmsNorm),
    cos: &Tensor,
    sin: &Tensor,
    heads: Heads,
    eps: f32,
) -> Result<Tensor, ModelError> {
    if [qkv, cos, sin].into_iter().all(kernels::cpu_f32) {
        let (c, s) = read_angles(cos, sin)?;
        let (qw, kw) = (&q_norm.weight, &k_norm.weight);
        return Ok(kernels::qk_norm_rope(
            qkv,
            qw,
            kw,
            c.values(),
            s.values(),
            heads,
            eps,
        )?);
    }
    qk_norm_rope_by_ops(qkv, (q_norm, k_norm), cos, sin, heads, eps)
}

/// [`rotate_qk_normed`] as candle ops: cards and f16/bf16.
fn qk_norm_rope_by_ops(
    qkv: &Tensor,
    (q_norm, k_norm): (&RmsNorm, &RmsNorm),
    cos: &Tensor,
    sin: &Tensor,
    heads: Heads,
    eps: f32,
) -> Result<Tensor, ModelError> {
    let Heads { q, kv, d } = heads;
    let n = qkv.dim(0)?;
    let qn = q_norm
        .forward(&qkv.narrow(1, 0, q * d)?.reshape((n, q, d))?, eps)?
        .reshape((n, q * d))?;
    let kn = k_norm
        .forward(&qkv.narrow(1, q * d, kv * d)?.reshape((n, kv, d))?, eps)?
        .reshape((n, kv * d))?;
    let v = qkv.narrow(1, (q + kv) * d, kv * d)?;
    rotate(&Tensor::cat(&[qn, kn, v], 1)?, cos, sin, heads)
}

/// [`rotate`] as candle ops: cards, f16 and bf16.
fn rotate_by_ops(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: Heads,
) -> Result<Tensor, ModelError> {
    let n = qkv.dim(0)?;
    let rotated = heads.q + heads.kv;
    let qk = qkv
        .narrow(1, 0, rotated * heads.d)?
        .to_dtype(DType::F32)?
        .contiguous()?
        .reshape((n, 1, rotated, heads.d))?;
    let qk = candle_nn::rotary_emb::rope_thd(&qk, cos, sin)?
        .reshape((n, rotated * heads.d))?
        .to_dtype(qkv.dtype())?;
    let v = qkv.narrow(1, rotated * heads.d, heads.kv * heads.d)?;
    Ok(Tensor::cat(&[qk, v], 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass CPU rotation gives the candle ops' bits, for multi-head and
    /// grouped-query heads, over enough tokens for several tasks of rows.
    #[test]
    fn the_cpu_pass_is_the_candle_ops() {
        for heads in [Heads { q: 6, kv: 6, d: 64 }, Heads { q: 4, kv: 2, d: 16 }] {
            let n = 300;
            let w = heads.qkv_width();
            let half = heads.d / 2;
            let wave = |k: usize, f: f32| (k as f32 * f).sin();
            let qkv: Vec<f32> = (0..n * w).map(|k| wave(k, 0.37) * 3.0).collect();
            let qkv = Tensor::from_vec(qkv, (n, w), &Device::Cpu).unwrap();
            let cos: Vec<f32> = (0..n * half).map(|k| wave(k, 0.11).cos()).collect();
            let sin: Vec<f32> = (0..n * half).map(|k| wave(k, 0.11).sin()).collect();
            let cos = Tensor::from_vec(cos, (n, 1, half), &Device::Cpu).unwrap();
            let sin = Tensor::from_vec(sin, (n, 1, half), &Device::Cpu).unwrap();
            let bits = |t: Tensor| -> Vec<u32> {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                v.into_iter().map(f32::to_bits).collect()
            };
            let fused = bits(rotate(&qkv, &cos, &sin, heads).unwrap());
            let ops = bits(rotate_by_ops(&qkv, &cos, &sin, heads).unwrap());
            assert_eq!(fused, ops, "{heads:?}");
        }
    }

    /// The CPU's fused pass (`kernels::qk_norm_rope`) is the candle chain cards and
    /// f16/bf16 run: per-head RMSNorm of Q and K with their own weights, then rotation;
    /// grouped K/V heads, several tokens at their own positions, V untouched.
    #[test]
    fn fused_qk_norm_and_rotation_match_the_candle_chain() {
        let heads = Heads { q: 4, kv: 2, d: 8 };
        let (n, dev) = (5, Device::Cpu);
        let t = |shape: &[usize], scale: f64| {
            (Tensor::randn(0f32, 1f32, shape, &dev).unwrap() * scale).unwrap()
        };
        let qkv = t(&[n, heads.qkv_width()], 3.0);
        let (qw, kw) = (t(&[heads.d], 1.0), t(&[heads.d], 1.0));
        let rope = Rope::new(1e6, heads.d, 64, &dev).unwrap();
        let pos = Tensor::new(&[0u32, 1, 2, 0, 40], &dev).unwrap();
        let (cos, sin) = rope.at(&pos).unwrap();
        let eps = 1e-6;
        let (q_norm, k_norm) = (RmsNorm { weight: qw }, RmsNorm { weight: kw });
        let norms = (&q_norm, &k_norm);
        let got = rotate_qk_normed(&qkv, norms, &cos, &sin, heads, eps).unwrap();
        let want = qk_norm_rope_by_ops(&qkv, norms, &cos, &sin, heads, eps).unwrap();

        let diff = kernels::tests::max_diff(&got, &want);
        assert!(diff < 1e-5, "max diff {diff}");
    }

    /// The rotation is transformers' rotate-half: (x1, x2) → (x1·cos − x2·sin,
    /// x2·cos + x1·sin) per head, on Q and K only (K with fewer heads too).
    #[test]
    fn rotate_turns_q_and_k_halves_and_keeps_v() {
        for heads in [Heads { q: 2, kv: 2, d: 4 }, Heads { q: 4, kv: 2, d: 4 }] {
            let w = heads.qkv_width();
            let qkv: Vec<f32> = (0..w).map(|i| i as f32 + 1.0).collect();
            let qkv = Tensor::from_vec(qkv.clone(), (1, w), &Device::Cpu).unwrap();
            let (c, s) = (0.6f32, 0.8f32);
            let cos = Tensor::new(&[[[c, c]]], &Device::Cpu).unwrap();
            let sin = Tensor::new(&[[[s, s]]], &Device::Cpu).unwrap();
            let got: Vec<f32> = rotate(&qkv, &cos, &sin, heads)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let x: Vec<f32> = qkv.flatten_all().unwrap().to_vec1().unwrap();
            let d = heads.d;
            for head in 0..heads.q + heads.kv {
                let b = head * d;
                for k in 0..d / 2 {
                    let (x1, x2) = (x[b + k], x[b + k + d / 2]);
                    assert!((got[b + k] - (x1 * c - x2 * s)).abs() < 1e-5);
                    assert!((got[b + k + d / 2] - (x2 * c + x1 * s)).abs() < 1e-5);
                }
            }
            let v = (heads.q + heads.kv) * d;
            assert_eq!(&got[v..], &x[v..]);
        }
    }
}
