//! A bound on the host memory tokenization takes: how many calls tokenize at once, and
//! what each may take. The `tokenizers` library builds every input whole before it
//! truncates (a normalized copy with an alignment pair per byte, then a token, an offset
//! pair and masks per token), so one call of a million characters peaks near a hundred
//! megabytes for a moment, whatever the model keeps of it. Unbounded, a flood of long
//! calls tokenizing on the blocking pool at once is what pushes a CPU box into swap; with
//! a few slots, the host's admission budget can hold their peak once
//! ([`Tokenizing::reserve`]).

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::{
    engine::{DeviceMemory, GiveBack},
    ModelError,
};

/// Host bytes tokenizing takes per character of a call's input at its peak, an upper
/// bound: the `tokenizers` library measured 56–116 bytes per character on English text
/// with all-MiniLM-L6-v2's tokenizer (RSS growth over calls of 1 to 10 texts of 1,000 to
/// 100,000 characters).
pub const TOKENIZING_BYTES_PER_CHAR: u64 = 128;

/// Tokenization slots shared by every engine of a process, and the host memory they are
/// told to (a simulated host's accounting).
pub struct Tokenizing {
    slots: Arc<Semaphore>,
    count: usize,
    memory: Option<Arc<dyn DeviceMemory>>,
}

impl Tokenizing {
    /// At most `slots` calls tokenize at once (at least one); each tells `memory` what it
    /// takes while it runs, and fails as out of memory where `memory` refuses it.
    pub fn new(slots: usize, memory: Option<Arc<dyn DeviceMemory>>) -> Arc<Self> {
        let count = slots.max(1);
        Arc::new(Self {
            slots: Arc::new(Semaphore::new(count)),
            count,
            memory,
        })
    }

    /// What one tokenizing call of `chars` characters may take at its peak.
    pub fn bytes(chars: usize) -> u64 {
        chars as u64 * TOKENIZING_BYTES_PER_CHAR
    }

    /// The most every slot together may take, for calls of at most `max_chars`
    /// characters each: what a host budget keeps for tokenizing.
    pub fn reserve(&self, max_chars: usize) -> u64 {
        self.count as u64 * Self::bytes(max_chars)
    }

    /// Runs `encode` (a tokenization of `chars` characters) on the blocking pool once a
    /// slot is free. The slot and the memory go with the work, not with this future: a
    /// call dropped mid-way (a cancelled activity) cannot free them while its
    /// tokenization still runs.
    pub async fn run<T: Send + 'static>(
        &self,
        chars: usize,
        encode: impl FnOnce() -> Result<T, ModelError> + Send + 'static,
    ) -> Result<T, ModelError> {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the tokenizing semaphore is never closed; this is a bug");
        let bytes = Self::bytes(chars);
        let held = match &self.memory {
            Some(m) => {
                m.take(bytes).map_err(ModelError::OutOfMemory)?;
                Some(GiveBack(m.clone(), bytes))
            }
            None => None,
        };
        blocking(move || {
            let _slot = slot;
            let _held = held;
            encode()
        })
        .await
    }
}

/// Runs `encode` on the blocking pool; a panic there is a bug, not the input's fault, so
/// it is retryable like a model failure.
pub(crate) async fn blocking<T: Send + 'static>(
    encode: impl FnOnce() -> Result<T, ModelError> + Send + 'static,
) -> Result<T, ModelError> {
    tokio::task::spawn_blocking(encode).await.map_err(|e| {
        ModelError::Candle(candle_core::Error::Msg(format!("tokenizing panicked: {e}")))
    })?
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Mutex,
    };

    use super::*;

    /// Host memory that records its most held bytes and refuses more than `room`.
    #[derive(Default)]
    struct Host {
        held: AtomicU64,
        peak: AtomicU64,
        room: u64,
    }

    impl DeviceMemory for Host {
        fn take(&self, bytes: u64) -> Result<(), String> {
            let now = self.held.fetch_add(bytes, Ordering::SeqCst) + bytes;
            if now > self.room {
                self.held.fetch_sub(bytes, Ordering::SeqCst);
                return Err(format!("{bytes} bytes over the room"));
            }
            self.peak.fetch_max(now, Ordering::SeqCst);
            Ok(())
        }
        fn give_back(&self, bytes: u64) {
            self.held.fetch_sub(bytes, Ordering::SeqCst);
        }
        fn hold(&self, _bytes: u64) {}
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn at_most_the_slots_tokenize_at_once_and_their_memory_is_told() {
        let host = Arc::new(Host {
            room: u64::MAX,
            ..Host::default()
        });
        let gate = Tokenizing::new(2, Some(host.clone() as Arc<dyn DeviceMemory>));
        let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let calls: Vec<_> = (0..12)
            .map(|_| {
                let (gate, now, most) = (gate.clone(), now.clone(), most.clone());
                tokio::spawn(async move {
                    gate.run(1000, move || {
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        now.fetch_sub(1, Ordering::SeqCst);
                        Ok(n)
                    })
                    .await
                })
            })
            .collect();
        for c in calls {
            c.await.unwrap().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 2, "never more than the slots");
        assert_eq!(host.held.load(Ordering::SeqCst), 0, "every call gave back");
        assert_eq!(
            host.peak.load(Ordering::SeqCst),
            2 * Tokenizing::bytes(1000)
        );
        assert_eq!(gate.reserve(1000), host.peak.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_call_the_host_has_no_room_for_fails_as_out_of_memory() {
        let host = Arc::new(Host {
            room: Tokenizing::bytes(10),
            ..Host::default()
        });
        let gate = Tokenizing::new(1, Some(host.clone() as Arc<dyn DeviceMemory>));
        let ran = Arc::new(Mutex::new(false));
        let r = ran.clone();
        let e = gate
            .run(11, move || {
                *r.lock().unwrap() = true;
                Ok(())
            })
            .await
            .unwrap_err();
        assert!(matches!(e, ModelError::OutOfMemory(_)), "{e}");
        assert!(!*ran.lock().unwrap(), "refused before tokenizing");
        gate.run(10, || Ok(())).await.unwrap();
        assert_eq!(host.held.load(Ordering::SeqCst), 0);
    }
}
