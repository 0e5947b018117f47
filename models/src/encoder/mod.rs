//! gpulane's own forward passes, over *packed* rows: the tokens of every row of a batch
//! concatenated, with no padding. One file per family: `bert` (BERT, XLM-RoBERTa,
//! DistilBERT and MPNet, which share post-norm layers), `mpnet` (its relative position
//! bias), `modernbert` and `qwen3`; `batch` lays out rows and runs attention, `layers`,
//! `act` and `rope` are the pieces families share.
//!
//! Why not candle-transformers' models: they pad every row to the batch's longest and run
//! every dense layer over the padding too (17% of the tokens of a short-sentence corpus
//! even after length sorting), and their element-wise steps were slow on the CPU (see
//! `kernels`). Here the dense layers (three quarters of the FLOPs) see only real tokens,
//! and so does attention on the CPU in f32 and on cards (the varlen kernel); only the
//! CPU in f16/bf16 and `--gpu-attention padded` pad attention, per length group. Weights
//! are laid out once at load for the fused steps: Q, K and V as one matrix with the 1/√d
//! scale folded in, every matrix transposed to `[in, out]`.

mod act;
mod batch;
mod bert;
mod layers;
mod modernbert;
mod mpnet;
mod qwen3;
mod rope;

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

pub use self::batch::Attention;
use self::layers::Weight;
pub(crate) use self::{
    act::Act,
    batch::{Route, Routing},
    layers::Norm,
};
use self::{bert::Bert, modernbert::ModernBert, qwen3::Qwen3};
use crate::{
    batcher::Row,
    config::{Arch, ModelConfig},
    kernels::{self, CpuF32},
    ModelError, Pooling,
};

/// A loaded encoder of any family gpulane runs. Blocking: call it from an engine thread.
pub(crate) enum Encoder {
    Bert(Bert),
    ModernBert(ModernBert),
    Qwen3(Qwen3),
}

impl Encoder {
    /// Loads the encoder of the checkpoint at `vb` (its root; each family finds its own
    /// prefix), as `config` describes it.
    pub(crate) fn load(
        config: &ModelConfig,
        vb: VarBuilder,
        path: &std::path::Path,
    ) -> Result<Self, ModelError> {
        let mut enc = match &config.arch {
            Arch::ModernBert(c) => Encoder::ModernBert(ModernBert::load(c, vb, path)?),
            Arch::Qwen3(c) => Encoder::Qwen3(Qwen3::load(c, vb, path)?),
            _ => Encoder::Bert(Bert::load(config, vb, path)?),
        };
        for w in enc.dense_weights() {
            w.pack_for_cpu()?;
        }
        Ok(enc)
    }

    fn dense_weights(&mut self) -> Vec<&mut Weight> {
        match self {
            Encoder::Bert(m) => m.dense_weights(),
            Encoder::ModernBert(m) => m.dense_weights(),
            Encoder::Qwen3(m) => m.dense_weights(),
        }
    }

    fn routing(&mut self) -> &mut Routing {
        match self {
            Encoder::Bert(m) => &mut m.routing,
            Encoder::ModernBert(m) => &mut m.routing,
            Encoder::Qwen3(m) => &mut m.routing,
        }
    }

    /// Which route attention takes on a card.
    pub(crate) fn set_attention(&mut self, card: Attention) {
        self.routing().card = card;
    }

    /// Makes attention take `route` on every device, the CPU in f32 included, so tests
    /// can hold a card's routes (the padded one, the varlen kernel's CPU twin) to the f32
    /// references.
    pub(crate) fn force_route(&mut self, route: Route) {
        self.routing().forced = Some(route);
    }

    /// Quantizes the dense layers to int8 for the CPU (`EngineOptions::int8`); attention,
    /// norms and embeddings stay f32.
    pub(crate) fn quantize_int8(&mut self) -> Result<(), ModelError> {
        for w in self.dense_weights() {
            w.quantize_int8()?;
        }
        Ok(())
    }

    /// Token vectors for `rows`, packed (see the module doc).
    pub(crate) fn forward(&self, rows: &[&Row]) -> Result<Packed, ModelError> {
        match self {
            Encoder::Bert(m) => m.forward(rows),
            Encoder::ModernBert(m) => m.forward(rows),
            Encoder::Qwen3(m) => m.forward(rows),
        }
    }
}

/// Token vectors of a packed batch: `[N, H]` for N real tokens, with each row's start,
/// length, and leading tokens left out of pooling.
pub(crate) struct Packed {
    pub(crate) hidden: Tensor,
    pub(crate) starts: Vec<usize>,
    pub(crate) lens: Vec<usize>,
    pub(crate) skips: Vec<usize>,
}

impl Packed {
    /// The vector of one token of each row, `offset(start, len)` its packed index, `[B, H]`.
    fn pick(&self, offset: impl Fn(usize, usize) -> usize) -> Result<Tensor, ModelError> {
        let idx: Vec<u32> = self
            .starts
            .iter()
            .zip(&self.lens)
            .map(|(&s, &l)| offset(s, l) as u32)
            .collect();
        let n = idx.len();
        let idx = Tensor::from_vec(idx, n, self.hidden.device())?;
        Ok(self.hidden.index_select(&idx, 0)?)
    }

    /// The first token's vector of each row (`[CLS]` / `<s>`), `[B, H]`.
    pub(crate) fn first_tokens(&self) -> Result<Tensor, ModelError> {
        self.pick(|s, _| s)
    }

    /// Mean or mean-sqrt-len pooling of CPU f32 token vectors: each row's tokens summed
    /// in order, then divided by their count (or its square root) as sentence-transformers
    /// does. Not the cards' `[B, N]` matmul: its blocking sums a row's tokens in groups
    /// that depend on where the row sits in the batch, so a text's vector moved by an ulp
    /// with its batch-mates (`tests/fixtures.rs`' `a_texts_vector_does_not_depend_on_its_batch`).
    fn mean_on_cpu(&self, pooling: Pooling) -> Result<Tensor, ModelError> {
        let h = self.hidden.dim(1)?;
        let mut out = vec![0f32; self.lens.len() * h];
        let x = CpuF32::read(&self.hidden, "pooled tokens")?;
        let x = x.values();
        let rows = self.starts.iter().zip(&self.lens).zip(&self.skips);
        for (o, ((&s, &len), &skip)) in out.chunks_exact_mut(h).zip(rows) {
            for token in x[(s + skip) * h..(s + len) * h].chunks_exact(h) {
                kernels::add_into(o, token);
            }
            // sentence-transformers clamps the count at 1e-9.
            let count = ((len - skip) as f32).max(1e-9);
            let by = if pooling == Pooling::Mean {
                count
            } else {
                count.sqrt()
            };
            o.iter_mut().for_each(|v| *v /= by);
        }
        Ok(Tensor::from_vec(
            out,
            (self.lens.len(), h),
            self.hidden.device(),
        )?)
    }

    /// One vector per row under `pooling`, `[B, H]` in f32. Mean, max and mean-sqrt-len
    /// leave out each row's skipped leading tokens, as sentence-transformers' pooling does
    /// with `include_prompt: false`; CLS and last-token pooling take their token as is.
    pub(crate) fn pool(&self, pooling: Pooling) -> Result<Tensor, ModelError> {
        // CLS and last-token convert only the rows they keep; the others read every token.
        let hidden = || self.hidden.to_dtype(DType::F32);
        Ok(match pooling {
            Pooling::Cls => self.first_tokens()?.to_dtype(DType::F32)?,
            // Rows are never empty: `refuse_empty` stops a call with a row of no tokens.
            Pooling::LastToken => self.pick(|s, l| s + l.max(1) - 1)?.to_dtype(DType::F32)?,
            Pooling::Mean | Pooling::MeanSqrtLen if kernels::cpu_f32(&self.hidden) => {
                self.mean_on_cpu(pooling)?
            }
            Pooling::Mean | Pooling::MeanSqrtLen => {
                let hidden = hidden()?;
                // A [B, N] weight matrix: one matmul averages every row's own tokens.
                let (b, n) = (self.lens.len(), hidden.dim(0)?);
                let mut w = vec![0f32; b * n];
                for (i, ((&s, &len), &skip)) in self
                    .starts
                    .iter()
                    .zip(&self.lens)
                    .zip(&self.skips)
                    .enumerate()
                {
                    let used = len - skip;
                    // sentence-transformers clamps the count at 1e-9.
                    let count = (used as f32).max(1e-9);
                    let weight = if pooling == Pooling::Mean {
                        1.0 / count
                    } else {
                        1.0 / count.sqrt()
                    };
                    w[i * n + s + skip..i * n + s + len].fill(weight);
                }
                Tensor::from_vec(w, (b, n), hidden.device())?.matmul(&hidden)?
            }
            Pooling::Max => {
                let hidden = hidden()?;
                let h = hidden.dim(1)?;
                let rows = self
                    .starts
                    .iter()
                    .zip(&self.lens)
                    .zip(&self.skips)
                    .map(|((&s, &len), &skip)| {
                        if skip >= len {
                            Tensor::zeros(h, DType::F32, hidden.device())
                        } else {
                            hidden.narrow(0, s + skip, len - skip)?.max(0)
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::stack(&rows, 0)?
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// Two packed rows: three tokens, then two.
    fn packed(skips: Vec<usize>) -> Packed {
        let hidden = Tensor::new(
            &[[1f32, 2.], [3., 4.], [5., 6.], [1., -1.], [3., 1.]],
            &Device::Cpu,
        )
        .unwrap();
        Packed {
            hidden,
            starts: vec![0, 3],
            lens: vec![3, 2],
            skips,
        }
    }

    fn pool(p: Pooling) -> Vec<Vec<f32>> {
        packed(vec![0, 0]).pool(p).unwrap().to_vec2().unwrap()
    }

    #[test]
    fn mean_averages_each_rows_own_tokens() {
        assert_eq!(pool(Pooling::Mean), vec![vec![3., 4.], vec![2., 0.]]);
    }

    #[test]
    fn cls_takes_each_rows_first_token() {
        assert_eq!(pool(Pooling::Cls), vec![vec![1., 2.], vec![1., -1.]]);
    }

    #[test]
    fn last_token_takes_each_rows_last_token() {
        assert_eq!(pool(Pooling::LastToken), vec![vec![5., 6.], vec![3., 1.]]);
    }

    #[test]
    fn max_stays_within_each_row() {
        assert_eq!(pool(Pooling::Max), vec![vec![5., 6.], vec![3., 1.]]);
    }

    #[test]
    fn mean_sqrt_len_divides_by_root_count() {
        let out = pool(Pooling::MeanSqrtLen);
        assert!((out[1][0] - 4. / 2f32.sqrt()).abs() < 1e-6 && out[1][1].abs() < 1e-6);
        assert!((out[0][0] - 9. / 3f32.sqrt()).abs() < 1e-5);
    }

    /// A skipped prompt is left out of mean and max, never out of the last token.
    #[test]
    fn skipped_leading_tokens_are_not_pooled() {
        let p = packed(vec![1, 0]);
        let mean: Vec<Vec<f32>> = p.pool(Pooling::Mean).unwrap().to_vec2().unwrap();
        assert_eq!(mean, vec![vec![4., 5.], vec![2., 0.]]);
        let max: Vec<Vec<f32>> = p.pool(Pooling::Max).unwrap().to_vec2().unwrap();
        assert_eq!(max[0], vec![5., 6.]);
        let last: Vec<Vec<f32>> = p.pool(Pooling::LastToken).unwrap().to_vec2().unwrap();
        assert_eq!(last[0], vec![5., 6.]);
    }
}
