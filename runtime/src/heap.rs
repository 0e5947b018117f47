//! The process heap between bursts of work.

/// Hands freed heap memory back to the kernel. The binary turns glibc's trimming off so
/// that freed activations are reused by the next batch (see `keep_freed_memory` in
/// main.rs); without this, one large call would leave the process at its peak for good.
/// Called when an engine has been idle for a while (not between batches); it locks the
/// allocator's arenas briefly, which other engines' threads may wait on.
pub(crate) fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
