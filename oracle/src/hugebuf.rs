//! The weight store's memory: a buffer of a megabyte or more is copied into its own anonymous
//! mapping, aligned to 2 MiB and advised `MADV_HUGEPAGE`, so that where the OS grants
//! transparent huge pages (Linux's `madvise` and `always` modes) the weights stream without a
//! page walk per 4 KiB. On a SmolLM2-sized f32 store (540 MB, one vector) this lifts the GEMV
//! from 18 to 24.5 GB/s on a 2-thread Intel Xeon VM (`cargo run --release -p oracle --example
//! gemv_sweep`). Smaller buffers, other systems, and a mapping the OS refuses stay on the heap:
//! the values and every result computed from them are the same either way. The move is a copy, so
//! while one matrix moves it is held twice: SmolLM2's peak RSS goes from 649 to 758 MB (its
//! 113 MB output head), beyond what `memory::check_fits` counts.

use std::ops::Deref;

/// Buffers from this size on get their own mapping.
const MAPPED_FROM_BYTES: usize = 1 << 20;
/// Transparent huge page size on x86-64 and most aarch64 Linux kernels.
const HUGE: usize = 2 << 20;

/// An immutable buffer of `T`, on huge pages where the OS allows.
pub struct HugeBuf<T> {
    inner: Inner<T>,
}

enum Inner<T> {
    Heap(Vec<T>),
    /// `len` values at `ptr`, inside a mapping of `map_len` bytes that starts at `ptr`.
    #[cfg(target_os = "linux")]
    Mapped { ptr: std::ptr::NonNull<T>, len: usize, map_len: usize },
}

// The mapping is owned and never written after construction: sharing it is sharing a `&[T]`.
unsafe impl<T: Send> Send for HugeBuf<T> {}
unsafe impl<T: Sync> Sync for HugeBuf<T> {}

impl<T> HugeBuf<T> {
    /// Whether the values live in their own huge-page-advised mapping.
    pub fn is_mapped(&self) -> bool {
        !matches!(self.inner, Inner::Heap(_))
    }
}

impl<T: Copy> HugeBuf<T> {
    /// Takes `v`; a megabyte or more moves into a huge-page mapping (one copy).
    pub fn from_vec(v: Vec<T>) -> HugeBuf<T> {
        #[cfg(target_os = "linux")]
        if std::mem::size_of_val(v.as_slice()) >= MAPPED_FROM_BYTES {
            if let Some(b) = Self::mapped(&v) {
                return b;
            }
        }
        HugeBuf { inner: Inner::Heap(v) }
    }

    #[cfg(target_os = "linux")]
    fn mapped(v: &[T]) -> Option<HugeBuf<T>> {
        let bytes = std::mem::size_of_val(v);
        let map_len = bytes.checked_next_multiple_of(HUGE)?;
        // Map one huge page more than needed, then trim the head and tail so that the mapping
        // starts on a 2 MiB boundary.
        let span = map_len.checked_add(HUGE)?;
        // SAFETY: an anonymous private mapping with no address hint; failure is checked.
        let raw = unsafe { libc::mmap(std::ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE);
        let (head, tail) = (aligned - start, span - (aligned - start) - map_len);
        // SAFETY: both ranges lie inside the mapping just made and outside the part kept; the
        // advice is a hint whose failure changes nothing but speed.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + map_len) as *mut libc::c_void, tail);
            }
            libc::madvise(aligned as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE);
        }
        let ptr = std::ptr::NonNull::new(aligned as *mut T)?;
        // SAFETY: the mapping holds `map_len >= bytes` writable bytes, 2 MiB aligned (enough for
        // any T), and does not overlap `v`.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), ptr.as_ptr(), v.len()) };
        Some(HugeBuf { inner: Inner::Mapped { ptr, len: v.len(), map_len } })
    }
}

impl<T> Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.inner {
            Inner::Heap(v) => v,
            // SAFETY: `len` initialised values at `ptr`, alive until drop, never written again.
            #[cfg(target_os = "linux")]
            Inner::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

impl<T> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Inner::Mapped { ptr, map_len, .. } = self.inner {
            // SAFETY: the mapping made in `mapped`, unmapped once.
            unsafe { libc::munmap(ptr.as_ptr() as *mut libc::c_void, map_len) };
        }
    }
}

impl<T: Copy> Clone for HugeBuf<T> {
    fn clone(&self) -> HugeBuf<T> {
        HugeBuf::from_vec(self.to_vec())
    }
}

impl<T> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf({} values{})", self.len(), if self.is_mapped() { ", mapped" } else { "" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_survive_the_move_small_and_large() {
        for n in [0usize, 7, 300_000, (3 << 20) / 4 + 5] {
            let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let b = HugeBuf::from_vec(v.clone());
            assert_eq!(&b[..], &v[..], "{n} values");
            assert_eq!(b.is_mapped(), cfg!(target_os = "linux") && n * 4 >= MAPPED_FROM_BYTES, "{n}");
            if b.is_mapped() {
                assert_eq!(b.as_ptr() as usize % HUGE, 0, "2 MiB aligned");
            }
            let c = b.clone();
            drop(b);
            assert_eq!(&c[..], &v[..]);
        }
    }
}
