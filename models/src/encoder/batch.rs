//! One batch's rows laid out for a forward pass, and its attention: the fused packed
//! kernel on the CPU in f32, a padded `[B, heads, T, T]` path everywhere else.

use std::cell::OnceCell;

use candle_core::{DType, Device, Tensor};

use super::Packed;
use crate::{
    batcher::Row,
    kernels::{self, Heads, Mask},
    ModelError,
};

/// Packed token ids, each token's position in its row, each row's start and length, and,
/// off the fused CPU path, what the padded attention path needs.
pub(crate) struct Batch {
    /// `[N]` token ids of every row, concatenated.
    pub(crate) ids: Tensor,
    /// Each packed token's position within its row, from 0.
    positions: Vec<u32>,
    starts: Vec<usize>,
    lens: Vec<usize>,
    /// Leading tokens of each row that pooling leaves out (a prompt, when the model's
    /// pooling config says `include_prompt: false`).
    skips: Vec<usize>,
    pad: Option<Padding>,
}

/// Which additive term besides the key mask a padded batch has built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    Window(usize),
    Causal,
    Relative,
}

/// Off the fused CPU path, attention gathers padded `[B, T]` from packed rows and
/// scatters back; padded slots read a real row (the row's last) and are masked out of
/// the softmax. Where padding sits in a row does not matter to the result: a padded slot
/// is never a key anyone sees, and its own output is dropped by the scatter, so rows are
/// padded on the right even for decoders (whose reference pads left), with positions
/// counted from each row's first real token.
struct Padding {
    b: usize,
    t: usize,
    gather: Tensor,
    scatter: Tensor,
    /// `[B, 1, 1, T]` in the model's dtype: 0 for real keys, −∞ for padding.
    mask: Tensor,
    /// `mask` plus the term of a sliding window, causal or relative mask: built by the
    /// first layer of a batch that needs it and reused by the others (every local layer
    /// of a model has the same window).
    extra: OnceCell<(Extra, Tensor)>,
}

impl Batch {
    /// Lays out `rows` for a model on `device` in `dtype`: only the CPU in f32 has the
    /// fused packed attention kernel; everything else takes the padded path.
    pub(crate) fn new(
        rows: &[&Row],
        device: &Device,
        dtype: DType,
        force_padded: bool,
    ) -> Result<Self, ModelError> {
        let lens: Vec<usize> = rows.iter().map(|r| r.len()).collect();
        let n: usize = lens.iter().sum();
        let (b, t) = (rows.len(), lens.iter().copied().max().unwrap_or(0));
        let padded = force_padded || !kernels::packed_attention_runs(device, dtype);
        let mut starts = Vec::with_capacity(b);
        let mut ids: Vec<u32> = Vec::with_capacity(n);
        let mut positions: Vec<u32> = Vec::with_capacity(n);
        let (mut gather, mut scatter, mut mask) = (Vec::new(), Vec::new(), Vec::new());
        for (i, r) in rows.iter().enumerate() {
            let start = ids.len();
            starts.push(start);
            ids.extend_from_slice(&r.ids);
            positions.extend(0..r.len() as u32);
            if padded {
                for k in 0..t {
                    gather.push((start + k.min(r.len().saturating_sub(1))) as u32);
                    mask.push(if k < r.len() { 0f32 } else { f32::NEG_INFINITY });
                }
                scatter.extend((0..r.len()).map(|k| (i * t + k) as u32));
            }
        }
        let pad = if padded {
            Some(Padding {
                b,
                t,
                gather: Tensor::from_vec(gather, b * t, device)?,
                scatter: Tensor::from_vec(scatter, n, device)?,
                mask: Tensor::from_vec(mask, (b, 1, 1, t), device)?.to_dtype(dtype)?,
                extra: Default::default(),
            })
        } else {
            None
        };
        Ok(Self {
            ids: Tensor::from_vec(ids, n, device)?,
            positions,
            starts,
            skips: rows.iter().map(|r| r.skip.min(r.len())).collect(),
            lens,
            pad,
        })
    }

    /// Real tokens in the batch.
    pub(crate) fn tokens(&self) -> usize {
        self.positions.len()
    }

    /// Whether attention takes the padded path.
    pub(crate) fn padded(&self) -> bool {
        self.pad.is_some()
    }

    /// The longest row, in tokens.
    pub(crate) fn longest(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    /// `[N]` each packed token's position id: its place in its row plus `first`.
    pub(crate) fn position_ids(&self, first: u32) -> Result<Tensor, ModelError> {
        let pos: Vec<u32> = self.positions.iter().map(|p| first + p).collect();
        Ok(Tensor::from_vec(pos, self.tokens(), self.ids.device())?)
    }

    /// Self-attention of packed `qkv` (`[N, (q + 2·kv)·d]`, Q pre-scaled by 1/√d) to its
    /// context `[N, q·d]`, each token seeing the keys of its own row that `mask` allows.
    pub(crate) fn attend(
        &self,
        qkv: &Tensor,
        heads: Heads,
        mask: Mask,
    ) -> Result<Tensor, ModelError> {
        let Some(p) = &self.pad else {
            return Ok(kernels::attention(
                qkv,
                &self.starts,
                &self.lens,
                heads,
                mask,
            )?);
        };
        let Heads { q: nq, kv: nkv, d } = heads;
        let (b, t) = (p.b, p.t);
        // [B*T, (q + 2kv)·d] → [B, q + 2kv, T, d], one copy for Q, K and V together.
        let qkv = qkv
            .index_select(&p.gather, 0)?
            .reshape((b, t, nq + 2 * nkv, d))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = qkv.narrow(1, 0, nq)?.contiguous()?;
        let repeat = |x: Tensor| -> Result<Tensor, ModelError> {
            if nq == nkv {
                return Ok(x);
            }
            // Each K/V head serves nq / nkv consecutive query heads (candle's repeat_kv).
            let group = nq / nkv;
            Ok(Tensor::cat(&vec![x; group], 2)?.reshape((b, nq, t, d))?)
        };
        let k = repeat(qkv.narrow(1, nq, nkv)?.contiguous()?)?;
        let v = repeat(qkv.narrow(1, nq + nkv, nkv)?.contiguous()?)?;
        let scores = q.matmul(&k.t()?)?;
        let key = match mask {
            Mask::Full => None,
            Mask::Window(w) => Some(Extra::Window(w)),
            Mask::Causal => Some(Extra::Causal),
            Mask::Relative(_) => Some(Extra::Relative),
        };
        let bias = match key {
            None => p.mask.clone(),
            Some(key) => match p.extra.get() {
                Some((cached, bias)) if *cached == key => bias.clone(),
                _ => {
                    let (dtype, dev) = (scores.dtype(), scores.device());
                    let term = match mask {
                        Mask::Window(w) => kernels::band(t, w, dtype, dev)?,
                        Mask::Causal => kernels::causal(t, dtype, dev)?,
                        Mask::Relative(r) => {
                            let full = r.padded.as_ref().ok_or_else(|| {
                                candle_core::Error::Msg("relative bias without its tensor".into())
                            })?;
                            // [1, heads, span, span] → the batch's [1, heads, T, T].
                            full.narrow(2, 0, t)?.narrow(3, 0, t)?.to_dtype(dtype)?
                        }
                        Mask::Full => unreachable!("no extra term for a full mask"),
                    };
                    let bias = p.mask.broadcast_add(&term)?;
                    let _ = p.extra.set((key, bias.clone()));
                    bias
                }
            },
        };
        let probs = kernels::masked_softmax(scores, &bias)?;
        Ok(probs
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * t, nq * d))?
            .index_select(&p.scatter, 0)?)
    }

    /// The batch's final token vectors `hidden` (`[N, H]`), with the rows they belong to.
    pub(crate) fn into_packed(self, hidden: Tensor) -> Packed {
        Packed {
            hidden,
            starts: self.starts,
            lens: self.lens,
            skips: self.skips,
        }
    }
}
