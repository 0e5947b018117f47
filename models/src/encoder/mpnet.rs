//! MPNet's relative position bias: one learned value per head for each of
//! `relative_attention_num_buckets` buckets of the distance j − i, exact for short
//! distances and logarithmic up to 128 (T5's bucketing, bidirectional), computed once per
//! batch and added to every layer's attention scores.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::Route;
use crate::{kernels::RelativeBias, ModelError};

/// Distances from which buckets are all the same (transformers' MPNet hard-codes it).
const MAX_DISTANCE: i64 = 128;

/// The learned `[buckets, heads]` table, kept in f32 on the host.
pub(crate) struct RelativeTable {
    buckets: usize,
    heads: usize,
    values: Vec<f32>,
}

/// transformers' `MPNetEncoder.relative_position_bucket` for `relative` = j − i.
pub(crate) fn bucket(relative: i64, num_buckets: usize) -> usize {
    let half = (num_buckets / 2) as i64;
    let n = -relative;
    let mut ret = if n < 0 { half } else { 0 };
    let n = n.abs();
    let max_exact = half / 2;
    ret += if n < max_exact {
        n
    } else {
        // Computed in f32 and truncated, as torch does on float tensors.
        let large = max_exact
            + ((n as f32 / max_exact as f32).ln() / (MAX_DISTANCE as f32 / max_exact as f32).ln()
                * (half - max_exact) as f32) as i64;
        large.min(half - 1)
    };
    ret as usize
}

impl RelativeTable {
    pub(crate) fn load(vb: &VarBuilder, buckets: usize, heads: usize) -> Result<Self, ModelError> {
        let w = vb.get((buckets, heads), "weight")?.to_dtype(DType::F32)?;
        Ok(Self {
            buckets,
            heads,
            values: w.flatten_all()?.to_vec1()?,
        })
    }

    /// The bias for rows of up to `span` tokens, laid out for `route`.
    pub(crate) fn bias(
        &self,
        span: usize,
        route: Route,
        device: &Device,
    ) -> Result<RelativeBias, ModelError> {
        let span = span.max(1);
        let width = 2 * span - 1;
        let mut table = vec![0f32; self.heads * width];
        for k in 0..width {
            let b = bucket(k as i64 - (span as i64 - 1), self.buckets);
            for h in 0..self.heads {
                table[h * width + k] = self.values[b * self.heads + h];
            }
        }
        laid_out(table, self.heads, span, route, device)
    }
}

/// `table` (`[heads · (2·span − 1)]`, by head and distance) as `route` reads it: as is
/// (packed), also on `device` (varlen), or also as `[1, heads, span, span]` (padded).
pub(crate) fn laid_out(
    table: Vec<f32>,
    heads: usize,
    span: usize,
    route: Route,
    device: &Device,
) -> Result<RelativeBias, ModelError> {
    let width = 2 * span - 1;
    let on_device = match route {
        Route::Varlen => Some(Tensor::from_slice(&table, table.len(), device)?),
        _ => None,
    };
    let padded = match route {
        Route::Padded => {
            let mut full = vec![0f32; heads * span * span];
            for h in 0..heads {
                for i in 0..span {
                    for j in 0..span {
                        full[(h * span + i) * span + j] = table[h * width + j + span - 1 - i];
                    }
                }
            }
            Some(Tensor::from_vec(full, (1, heads, span, span), device)?)
        }
        _ => None,
    };
    Ok(RelativeBias {
        span,
        table,
        on_device,
        padded,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values transformers' `relative_position_bucket(rp, 32, 128)` gives, worked by hand:
    /// exact below 8 either way, key-after-query in the upper half, logarithmic beyond.
    #[test]
    fn buckets_match_transformers() {
        let cases = [
            (0, 0),
            (-1, 1),
            (-7, 7),
            (1, 17),
            (7, 23),
            (-8, 8),
            (-16, 10),
            (-127, 15),
            (-1000, 15),
            (1000, 31),
            (20, 26),
        ];
        for (rel, want) in cases {
            assert_eq!(bucket(rel, 32), want, "relative position {rel}");
        }
    }
}
