//! A model directory's weights: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. PyTorch pickles are refused by name (loading one runs
//! arbitrary code, and candle reads safetensors). The revision that a result names comes
//! from here too.

use std::{
    collections::{BTreeSet, HashMap},
    io::Read,
    path::{Path, PathBuf},
    sync::{Mutex, OnceLock},
};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::{st_dir::read_json, ModelError};

/// The weight files of one model (or of one module folder, such as `2_Dense`).
#[derive(Debug, Clone)]
pub(crate) struct Checkpoint {
    pub files: Vec<PathBuf>,
    /// Floating-point parameters, from the files' headers.
    pub parameters: u64,
}

#[derive(Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

/// The conversion a user with a PyTorch-only checkpoint runs once.
const CONVERT: &str = "convert it once with `python -c \"from sentence_transformers import SentenceTransformer as S; S('DIR').save('DIR', safe_serialization=True)\"` (a cross-encoder: transformers' `AutoModelForSequenceClassification.from_pretrained('DIR').save_pretrained('DIR', safe_serialization=True)`)";

impl Checkpoint {
    /// Finds the weights in `dir`: `model.safetensors`, else the shards of
    /// `model.safetensors.index.json`. A folder with only `pytorch_model.bin` is refused
    /// naming the file and the conversion.
    pub(crate) fn open(dir: &Path) -> Result<Self, ModelError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            let idx: Index = read_json(&index)?;
            let names: BTreeSet<&String> = idx.weight_map.values().collect();
            if names.is_empty() {
                return Err(ModelError::Unsupported {
                    path: index,
                    reason: "weight_map lists no files".to_owned(),
                });
            }
            let mut files = Vec::with_capacity(names.len());
            for name in names {
                let shard = dir.join(name);
                // A shard name is a file beside the index, never a path elsewhere.
                if name.contains('/') || name.contains('\\') || !shard.is_file() {
                    return Err(missing(shard, &index));
                }
                files.push(shard);
            }
            files
        } else {
            for pickle in ["pytorch_model.bin", "pytorch_model.bin.index.json"] {
                let p = dir.join(pickle);
                if p.is_file() {
                    return Err(ModelError::Unsupported {
                        path: p,
                        reason: format!(
                            "PyTorch pickle weights; gpulane reads model.safetensors: {CONVERT}"
                        ),
                    });
                }
            }
            return Err(ModelError::File {
                path: single,
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        };
        let mut parameters = 0;
        for f in &files {
            parameters += count_parameters(f)?;
        }
        Ok(Self { files, parameters })
    }

    /// The weights mapped for candle, converted to `dtype` as they load: bf16- or
    /// f16-stored weights are upcast for the CPU's f32.
    pub(crate) fn var_builder(
        &self,
        dtype: DType,
        device: &Device,
    ) -> Result<VarBuilder<'static>, ModelError> {
        // SAFETY: the files are mapped read-only; gpulane does not write model files while
        // serving, and a user who rewrites them underneath a running worker gets garbage
        // embeddings, not memory unsafety in practice (candle copies into tensors).
        Ok(unsafe { VarBuilder::from_mmaped_safetensors(&self.files, dtype, device)? })
    }

    /// What a result names as the model's revision: the Hugging Face commit when the
    /// directory is a hub cache snapshot (`.../snapshots/<commit>/`), else `sha256:` and
    /// the hash of the weight files' bytes, in file-name order (computed once per process
    /// per file set).
    pub(crate) fn revision(&self, dir: &Path) -> Result<String, ModelError> {
        if let Some(commit) = hub_commit(dir) {
            return Ok(commit);
        }
        static SEEN: OnceLock<Mutex<HashMap<FileSet, String>>> = OnceLock::new();
        let key = self
            .files
            .iter()
            .map(|f| {
                let len = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
                (f.clone(), len)
            })
            .collect::<Vec<_>>();
        let seen = SEEN.get_or_init(Default::default);
        if let Some(r) = seen.lock().expect("revision cache poisoned").get(&key) {
            return Ok(r.clone());
        }
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        for f in &self.files {
            let io = |source| ModelError::File {
                path: f.clone(),
                source,
            };
            let mut file = std::fs::File::open(f).map_err(io)?;
            loop {
                let n = file.read(&mut buf).map_err(io)?;
                if n == 0 {
                    break;
                }
                hash.update(&buf[..n]);
            }
        }
        let hex: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        let revision = format!("sha256:{hex}");
        seen.lock()
            .expect("revision cache poisoned")
            .insert(key, revision.clone());
        Ok(revision)
    }
}

/// Weight files by path and length: the key revisions are remembered under.
type FileSet = Vec<(PathBuf, u64)>;

/// The commit of a Hugging Face cache snapshot directory, if `dir` is one.
fn hub_commit(dir: &Path) -> Option<String> {
    let name = dir.file_name()?.to_str()?;
    let parent = dir.parent()?.file_name()?.to_str()?;
    (parent == "snapshots" && name.len() == 40 && name.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| name.to_owned())
}

fn missing(shard: PathBuf, index: &Path) -> ModelError {
    ModelError::Unsupported {
        path: shard,
        reason: format!("listed by {} but not a file beside it", index.display()),
    }
}

/// Counts the floating-point parameters in a safetensors file from its header alone.
pub(crate) fn count_parameters(path: &Path) -> Result<u64, ModelError> {
    let io = |source| ModelError::File {
        path: path.to_owned(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(ModelError::Unsupported {
            path: path.to_owned(),
            reason: format!("safetensors header of {len} bytes is not plausible"),
        });
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|source| ModelError::Json {
            path: path.to_owned(),
            source,
        })?;
    let mut total = 0u64;
    for (name, t) in &header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t["dtype"].as_str().unwrap_or("");
        if !matches!(dtype, "F32" | "F16" | "BF16" | "F64") {
            continue;
        }
        let n: u64 = t["shape"]
            .as_array()
            .map(|d| d.iter().map(|x| x.as_u64().unwrap_or(0)).product())
            .unwrap_or(0);
        total += n;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pickle_only_folder_is_refused_naming_the_file_and_the_conversion() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pytorch_model.bin"), b"x").unwrap();
        let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("pytorch_model.bin"), "{err}");
        assert!(err.contains("safe_serialization=True"), "{err}");
    }

    #[test]
    fn a_shard_missing_from_the_index_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let err = Checkpoint::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("model-00001-of-00002.safetensors"), "{err}");
    }

    #[test]
    fn hub_snapshots_name_their_commit() {
        let c = "0123456789abcdef0123456789abcdef01234567";
        let p = PathBuf::from(format!("/h/models--a--b/snapshots/{c}"));
        assert_eq!(hub_commit(&p).as_deref(), Some(c));
        assert_eq!(hub_commit(Path::new("/x/model")), None);
    }

    #[test]
    fn the_revision_of_local_weights_is_their_hash() {
        let dir = tempfile::tempdir().unwrap();
        let t = candle_core::Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
        let f = dir.path().join("model.safetensors");
        candle_core::safetensors::save(&std::collections::HashMap::from([("w", t)]), &f).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.parameters, 3);
        let r = ck.revision(dir.path()).unwrap();
        let want: String = Sha256::digest(std::fs::read(&f).unwrap())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(r, format!("sha256:{want}"));
    }
}
