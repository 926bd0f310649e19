//! What the library's errors share, whichever module raises them: the text of a caught panic,
//! and whether a libtorch message says that memory ran out. The registry ([`crate::staged`])
//! and the streamer ([`crate::stream`]) both classify what a model's code threw with these.

/// The message a caught panic carried (`panic!` with a literal or a formatted string).
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_string())
}

/// Whether a libtorch error message is an out-of-memory (CUDA's "CUDA out of memory", the
/// caching allocator's `OutOfMemoryError`, the CPU allocator's "not enough memory").
pub(crate) fn is_out_of_memory(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    ["out of memory", "outofmemoryerror", "not enough memory", "can't allocate memory"]
        .iter()
        .any(|m| message.contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allocators_out_of_memory_messages_are_recognised_and_others_are_not() {
        assert!(is_out_of_memory("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"));
        assert!(is_out_of_memory("DefaultCPUAllocator: not enough memory: you tried to allocate 1099511627776 bytes."));
        assert!(is_out_of_memory(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes."
        ));
        assert!(!is_out_of_memory("shape mismatch"));
    }

    #[test]
    fn a_panic_says_its_message_whether_literal_or_formatted() {
        let literal = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_message(&*literal), "plain");
        let formatted = std::panic::catch_unwind(|| panic!("block {}", 3)).unwrap_err();
        assert_eq!(panic_message(&*formatted), "block 3");
        let other = std::panic::catch_unwind(|| std::panic::panic_any(7u8)).unwrap_err();
        assert_eq!(panic_message(&*other), "a panic with a non-string payload");
    }
}
