//! Building and using many tokenizers in one process holds no memory after they are dropped: the
//! tokenizers crate's BPE keeps cached words per thread and never frees them, so the oracle
//! builds its tokenizers with that cache off. Counted by this test binary's own allocator.

use oracle::gguf::{GgufFile, GgufWriter, Value};
use oracle::tokenizer::Tokenizer;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// Bytes allocated and not yet freed, by every thread of this test binary.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A byte-level BPE vocabulary (`gpt2`, Llama 3's split): the letters, `Ġ` (a space) and a few
/// merges.
fn byte_level_gguf() -> GgufFile {
    let mut tokens: Vec<String> = ('a'..='z').map(String::from).collect();
    tokens.extend(["Ġ", "Ġa", "ab", "Ġab"].map(String::from));
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.meta("tokenizer.ggml.pre", Value::String("llama-bpe".into()));
    w.meta("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::String).collect()));
    w.meta("tokenizer.ggml.merges", Value::Array(["Ġ a", "a b", "Ġa b"].map(|m| Value::String(m.into())).to_vec()));
    GgufFile::from_bytes("bpe.gguf", w.to_bytes()).unwrap()
}

/// 3,000 different words of letters, each of which a BPE cache would keep.
fn many_words() -> String {
    (0..3000u32).map(|i| (0..5).map(|d| char::from(b'a' + ((i / 26u32.pow(d)) % 26) as u8)).collect::<String>()).collect::<Vec<_>>().join(" ")
}

#[test]
fn tokenizers_built_and_dropped_hold_no_memory() {
    let g = byte_level_gguf();
    let text = many_words();
    let dir = tempfile::tempdir().unwrap();
    let first = Tokenizer::from_gguf(&g).unwrap();
    let ids = first.encode(&text).unwrap();
    assert!(ids.len() > 3000, "{}", ids.len());
    first.save(&dir.path().join("tokenizer.json")).unwrap();
    let from_json = Tokenizer::from_checkpoint(dir.path()).unwrap();
    assert_eq!(from_json.encode(&text).unwrap(), ids, "the tokenizer.json written reads back as the same tokenizer");
    drop((first, from_json));
    // Once warm (the shared pre-tokenizer compiled, the thread's maps made), every further
    // tokenizer of either kind must give back what it took.
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 0..20 {
        let t = Tokenizer::from_gguf(&g).unwrap();
        assert_eq!(t.encode(&text).unwrap(), ids);
        let t = Tokenizer::from_checkpoint(dir.path()).unwrap();
        assert_eq!(t.encode(&text).unwrap(), ids);
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;
    // Cached, each of the 40 tokenizers would keep its 3,000 words (about 10 MB in all).
    assert!(grown < 64 << 10, "{grown} bytes still held after 40 tokenizers were built, used and dropped");
}
