//! One batch's rows laid out for a forward pass, and its attention, by one of three routes:
//! the fused packed kernel on the CPU in f32; on cards, gpulane's varlen kernel (packed
//! rows, no padding, one launch per layer: `varlen.rs`); and the padded `[b, heads, t, t]`
//! path in candle ops, per *length group* so that one long row does not pad every short
//! one to its length (the CPU in f16/bf16, and cards with `--gpu-attention padded`).

use std::cell::OnceCell;

use candle_core::{DType, Device, Tensor};

use super::Packed;
use crate::{
    batcher::Row,
    kernels::{self, CardOps, Heads, Mask, Products},
    varlen::{self, Varlen},
    ModelError,
};

/// How a card runs attention and the element-wise steps (the CPU in f32 always runs its
/// own packed and fused kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Attention {
    /// gpulane's CUDA kernels: varlen attention over packed rows (no padding), fused
    /// bias+GELU, gated GELU and bias+residual+LayerNorm. Heads wider than 256 still pad
    /// their attention.
    #[default]
    Varlen,
    /// candle's ops throughout, attention padded per length group: the route before
    /// gpulane's CUDA kernels, kept to compare with and to fall back on.
    Padded,
}

impl Attention {
    /// The name the flags use: `varlen` or `padded`.
    pub fn as_str(self) -> &'static str {
        match self {
            Attention::Varlen => "varlen",
            Attention::Padded => "padded",
        }
    }
}

impl std::str::FromStr for Attention {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "varlen" => Ok(Attention::Varlen),
            "padded" => Ok(Attention::Padded),
            other => Err(format!("attention {other:?}: use varlen or padded")),
        }
    }
}

/// The route a batch takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Packed,
    Varlen,
    Padded,
}

/// What a model was told about routes: the card's choice, and a route forced on every
/// device (tests run the varlen twin and the padded path on the CPU in f32 this way).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Routing {
    pub(crate) card: Attention,
    pub(crate) forced: Option<Route>,
}

impl Routing {
    /// `forced` wins; else the CPU in f32 packs, a card takes its choice where the varlen
    /// kernel serves the dtype and heads of `head` dims, and everything else pads.
    pub(crate) fn pick(&self, device: &Device, dtype: DType, head: usize) -> Route {
        if let Some(r) = self.forced {
            return r;
        }
        if kernels::packed_attention_runs(device, dtype) {
            Route::Packed
        } else if device.is_cuda() && self.card == Attention::Varlen && varlen::serves(dtype, head)
        {
            Route::Varlen
        } else {
            Route::Padded
        }
    }

    /// The element-wise kernels a card runs with this routing's choice.
    pub(crate) fn card_ops(&self) -> CardOps {
        match self.card {
            Attention::Varlen => CardOps::Gpulane,
            Attention::Padded => CardOps::Candle,
        }
    }
}

/// Packed token ids, each token's position in its row, each row's start and length, and
/// what the batch's attention route needs besides.
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
    layout: Layout,
}

/// What the batch's route needs beyond the packed rows.
enum Layout {
    Packed,
    Varlen(Varlen),
    Padded(Padding),
}

/// Which additive term besides the key mask a padded batch has built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    Window(usize),
    Causal,
    Relative,
}

/// Padding a group's rows may add, as a share of their real tokens, before a shorter row
/// starts a group of its own. Each group costs its own kernel launches per layer, so
/// rows of near lengths (a length-sorted batch usually is one group) stay together.
const GROUP_SLACK: f64 = 0.25;

/// Off the fused CPU path, attention runs per length group: each gathers its rows into a
/// padded `[b, t]` from the packed ones, and one scatter takes every group's real tokens
/// back to packed order. Padded slots read a real row (the row's last) and are masked out
/// of the softmax. Where padding sits in a row does not matter to the result: a padded
/// slot is never a key anyone sees, and its own output is dropped by the scatter, so rows
/// are padded on the right even for decoders (whose reference pads left), with positions
/// counted from each row's first real token.
struct Padding {
    groups: Vec<Group>,
    /// `[N]`: for each packed token, its place in the groups' padded outputs laid end to
    /// end.
    scatter: Tensor,
}

/// Rows of near length, padded to the longest of them.
struct Group {
    b: usize,
    t: usize,
    /// `[b·t]` packed token indices.
    gather: Tensor,
    /// `[b, 1, 1, t]` in the model's dtype: 0 for real keys, −∞ for padding.
    mask: Tensor,
    /// `mask` plus the term of a sliding window, causal or relative mask: built by the
    /// first layer of a batch that needs it and reused by the others (every local layer
    /// of a model has the same window).
    extra: OnceCell<(Extra, Tensor)>,
}

/// Splits rows of `lens` into groups of near length: longest first, a row joins the
/// current group while padding every row to the group's longest adds at most
/// [`GROUP_SLACK`] of the group's real tokens. Each group lists its rows, longest first.
fn length_groups(lens: &[usize]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut real = 0;
    for i in order {
        if let Some(g) = groups.last_mut() {
            let t = lens[g[0]];
            let padded = t * (g.len() + 1);
            if padded as f64 <= (real + lens[i]) as f64 * (1.0 + GROUP_SLACK) {
                g.push(i);
                real += lens[i];
                continue;
            }
        }
        groups.push(vec![i]);
        real = lens[i];
    }
    groups
}

impl Batch {
    /// Lays out `rows` for a model on `device` in `dtype`, for attention by `route`.
    pub(crate) fn new(
        rows: &[&Row],
        device: &Device,
        dtype: DType,
        route: Route,
    ) -> Result<Self, ModelError> {
        let lens: Vec<usize> = rows.iter().map(|r| r.len()).collect();
        let n: usize = lens.iter().sum();
        let mut starts = Vec::with_capacity(rows.len());
        let mut ids: Vec<u32> = Vec::with_capacity(n);
        let mut positions: Vec<u32> = Vec::with_capacity(n);
        for r in rows {
            starts.push(ids.len());
            ids.extend_from_slice(&r.ids);
            positions.extend(0..r.len() as u32);
        }
        let layout = match route {
            Route::Packed => Layout::Packed,
            Route::Varlen => Layout::Varlen(Varlen::new(&starts, &lens, device)?),
            Route::Padded => Layout::Padded(Padding::new(&starts, &lens, device, dtype)?),
        };
        Ok(Self {
            ids: Tensor::from_vec(ids, n, device)?,
            positions,
            starts,
            skips: rows.iter().map(|r| r.skip.min(r.len())).collect(),
            lens,
            layout,
        })
    }

    /// Real tokens in the batch.
    pub(crate) fn tokens(&self) -> usize {
        self.positions.len()
    }

    /// The route attention takes.
    pub(crate) fn route(&self) -> Route {
        match self.layout {
            Layout::Packed => Route::Packed,
            Layout::Varlen(_) => Route::Varlen,
            Layout::Padded(_) => Route::Padded,
        }
    }

    /// Each row's tokens, in the packed order.
    pub(crate) fn lens(&self) -> &[usize] {
        &self.lens
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
    /// context `[N, q·d]`, each token seeing the keys of its own row that `mask` allows;
    /// the packed CPU route multiplies in `products` (the others in their dtype).
    pub(crate) fn attend(
        &self,
        qkv: &Tensor,
        heads: Heads,
        mask: Mask,
        products: Products,
    ) -> Result<Tensor, ModelError> {
        let p = match &self.layout {
            Layout::Packed => {
                let (starts, lens) = (&self.starts, &self.lens);
                return Ok(kernels::attention(
                    qkv, starts, lens, heads, mask, products,
                )?);
            }
            Layout::Varlen(v) => {
                return Ok(v.attend(qkv, (&self.starts, &self.lens), heads, mask)?)
            }
            Layout::Padded(p) => p,
        };
        let outs = p
            .groups
            .iter()
            .map(|g| g.attend(qkv, heads, mask))
            .collect::<Result<Vec<_>, _>>()?;
        let out = if outs.len() == 1 {
            outs.into_iter().next().expect("one group")
        } else {
            Tensor::cat(&outs, 0)?
        };
        Ok(out.index_select(&p.scatter, 0)?)
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

impl Padding {
    /// The length groups of rows at `starts` with `lens`, and the scatter back.
    fn new(
        starts: &[usize],
        lens: &[usize],
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let n: usize = lens.iter().sum();
        let mut scatter = vec![0u32; n];
        let mut offset = 0;
        let mut groups = Vec::new();
        for rows in length_groups(lens) {
            let (b, t) = (rows.len(), lens[rows[0]]);
            let (mut gather, mut mask) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
            for (j, &i) in rows.iter().enumerate() {
                let (start, len) = (starts[i], lens[i]);
                for k in 0..t {
                    gather.push((start + k.min(len.saturating_sub(1))) as u32);
                    mask.push(if k < len { 0f32 } else { f32::NEG_INFINITY });
                }
                for k in 0..len {
                    scatter[start + k] = (offset + j * t + k) as u32;
                }
            }
            offset += b * t;
            groups.push(Group {
                b,
                t,
                gather: Tensor::from_vec(gather, b * t, device)?,
                mask: Tensor::from_vec(mask, (b, 1, 1, t), device)?.to_dtype(dtype)?,
                extra: OnceCell::new(),
            });
        }
        Ok(Self {
            groups,
            scatter: Tensor::from_vec(scatter, n, device)?,
        })
    }
}

impl Group {
    /// Attention of the group's rows: `[b·t, q·d]`, padded slots included.
    fn attend(&self, qkv: &Tensor, heads: Heads, mask: Mask) -> Result<Tensor, ModelError> {
        let Heads { q: nq, kv: nkv, d } = heads;
        let (b, t) = (self.b, self.t);
        // [b·t, (q + 2kv)·d] → [b, q + 2kv, t, d], one copy for Q, K and V together.
        let qkv = qkv
            .index_select(&self.gather, 0)?
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
            None => self.mask.clone(),
            Some(key) => match self.extra.get() {
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
                            // [1, heads, span, span] → the group's [1, heads, t, t].
                            full.narrow(2, 0, t)?.narrow(3, 0, t)?.to_dtype(dtype)?
                        }
                        Mask::Full => unreachable!("no extra term for a full mask"),
                    };
                    let bias = self.mask.broadcast_add(&term)?;
                    let _ = self.extra.set((key, bias.clone()));
                    bias
                }
            },
        };
        let probs = kernels::masked_softmax(scores, &bias)?;
        Ok(probs
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * t, nq * d))?)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::encoder::mpnet::laid_out;

    #[test]
    fn rows_of_near_length_share_a_group_and_a_long_one_stands_alone() {
        // Length-sorted or not, rows within a quarter of padding stay together.
        assert_eq!(length_groups(&[10, 9, 12, 11]), vec![vec![2, 3, 0, 1]]);
        // One long row would pad seven short ones to 200 tokens: it goes alone.
        let lens = [12, 200, 10, 11, 12, 9, 10, 12];
        let groups = length_groups(&lens);
        assert_eq!(groups[0], vec![1]);
        assert_eq!(groups.len(), 2, "{groups:?}");
        assert_eq!(groups.iter().map(Vec::len).sum::<usize>(), lens.len());
        for g in &groups {
            let t = lens[g[0]];
            let real: usize = g.iter().map(|&i| lens[i]).sum();
            assert!((t * g.len()) as f64 <= real as f64 * (1.0 + GROUP_SLACK));
        }
        assert!(length_groups(&[]).is_empty());
    }

    /// The grouped padded path's and the varlen route's index arithmetic: every packed
    /// token reads its own row (its window, its causal prefix, its relative bias) and lands
    /// back in its own place, for every mask, against the packed CPU kernel.
    #[test]
    fn padded_and_varlen_attention_match_the_packed_kernel() {
        let lens = [7usize, 1, 30, 3, 29, 8, 2, 31];
        let rows: Vec<Row> = lens
            .iter()
            .map(|&l| Row::single((0..l as u32).collect()))
            .collect();
        let refs: Vec<&Row> = rows.iter().collect();
        let heads = Heads { q: 4, kv: 2, d: 8 };
        let n: usize = lens.iter().sum();
        let qkv = Tensor::randn(0f32, 1f32, (n, heads.qkv_width()), &Device::Cpu).unwrap();
        let batch = |route| Batch::new(&refs, &Device::Cpu, DType::F32, route).unwrap();
        let (packed, padded, varlen) = (
            batch(Route::Packed),
            batch(Route::Padded),
            batch(Route::Varlen),
        );
        let Layout::Padded(p) = &padded.layout else {
            panic!("the padded route lays out groups");
        };
        assert!(
            p.groups.len() >= 3,
            "{} groups for lengths {lens:?}",
            p.groups.len()
        );
        let relative = relative_bias(heads.q, 31);
        for mask in [
            Mask::Full,
            Mask::Window(4),
            Mask::Causal,
            Mask::Relative(&relative),
        ] {
            let want = packed.attend(&qkv, heads, mask, Products::F32).unwrap();
            for (name, other) in [("padded", &padded), ("varlen", &varlen)] {
                let got = other.attend(&qkv, heads, mask, Products::F32).unwrap();
                let diff: f32 = (&want - got)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar()
                    .unwrap();
                assert!(diff < 1e-5, "{name}, {mask:?}: max diff {diff}");
            }
        }
    }

    /// A relative bias that differs by head and by signed distance, laid out for every
    /// route at once.
    fn relative_bias(heads: usize, span: usize) -> kernels::RelativeBias {
        let table: Vec<f32> = (0..heads * (2 * span - 1))
            .map(|k| ((k * 7919) % 23) as f32 * 0.1 - 1.0)
            .collect();
        let padded = laid_out(table.clone(), heads, span, Route::Padded, &Device::Cpu).unwrap();
        kernels::RelativeBias {
            padded: padded.padded,
            ..laid_out(table, heads, span, Route::Varlen, &Device::Cpu).unwrap()
        }
    }
}
