//! `CUDA_VISIBLE_DEVICES`, interpreted the way the CUDA runtime does, so that the cards we
//! advertise are exactly the cards candle can open, with the same ordinals.

use super::GpuDevice;

/// Keeps the cards `spec` makes visible, in the order it lists them, and sets each one's
/// `cuda_ordinal` to its position. `None` (unset) keeps all cards in NVML order. Entries
/// are NVML indices (valid under `CUDA_DEVICE_ORDER=PCI_BUS_ID`) or UUIDs, full or a
/// unique prefix, with or without the `GPU-` prefix. As in CUDA, an empty value hides
/// every card and parsing stops at the first entry that matches nothing.
pub(crate) fn filter_visible(all: &[GpuDevice], spec: Option<&str>) -> Vec<GpuDevice> {
    let Some(spec) = spec else {
        return all
            .iter()
            .enumerate()
            .map(|(i, d)| GpuDevice {
                cuda_ordinal: i,
                ..d.clone()
            })
            .collect();
    };
    let mut out: Vec<GpuDevice> = Vec::new();
    for entry in spec.split(',').map(str::trim) {
        let found = if let Ok(index) = entry.parse::<u32>() {
            all.iter().find(|d| d.index == index)
        } else {
            let want = entry.to_ascii_lowercase();
            let want = want.strip_prefix("gpu-").unwrap_or(&want).to_owned();
            let matches: Vec<&GpuDevice> = all
                .iter()
                .filter(|d| {
                    let u = d.uuid.to_ascii_lowercase();
                    let u = u.strip_prefix("gpu-").unwrap_or(&u).to_owned();
                    !want.is_empty() && u.starts_with(&want)
                })
                .collect();
            // An ambiguous prefix is invalid in CUDA too.
            if matches.len() == 1 {
                Some(matches[0])
            } else {
                None
            }
        };
        match found {
            Some(d) if !out.iter().any(|o| o.uuid == d.uuid) => out.push(GpuDevice {
                cuda_ordinal: out.len(),
                ..d.clone()
            }),
            // CUDA treats a repeated or unknown entry as the end of the list.
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cards() -> Vec<GpuDevice> {
        (0..3)
            .map(|i| GpuDevice {
                uuid: format!("GPU-{i}{i}{i}a-0000"),
                index: i,
                cuda_ordinal: i as usize,
                name: "card".into(),
                total_memory: 1 << 30,
                simulated: true,
            })
            .collect()
    }

    fn uuids(v: &[GpuDevice]) -> Vec<(String, usize)> {
        v.iter().map(|d| (d.uuid.clone(), d.cuda_ordinal)).collect()
    }

    #[test]
    fn unset_keeps_all_in_order() {
        assert_eq!(filter_visible(&cards(), None).len(), 3);
    }

    #[test]
    fn empty_hides_all() {
        assert!(filter_visible(&cards(), Some("")).is_empty());
    }

    #[test]
    fn indices_reorder_and_renumber() {
        let v = filter_visible(&cards(), Some("2,0"));
        assert_eq!(
            uuids(&v),
            vec![("GPU-222a-0000".into(), 0), ("GPU-000a-0000".into(), 1)]
        );
    }

    #[test]
    fn uuids_and_prefixes_match() {
        let v = filter_visible(&cards(), Some("GPU-111a-0000,gpu-222"));
        assert_eq!(
            uuids(&v),
            vec![("GPU-111a-0000".into(), 0), ("GPU-222a-0000".into(), 1)]
        );
    }

    #[test]
    fn stops_at_first_invalid_entry_like_cuda() {
        let v = filter_visible(&cards(), Some("1,7,0"));
        assert_eq!(uuids(&v), vec![("GPU-111a-0000".into(), 0)]);
        assert!(filter_visible(&cards(), Some("-1")).is_empty());
    }
}
