//! The `tracing` subscriber every demo installs: the library's warnings (names that differ in a
//! lenient load, a pinned-memory fallback, ...) reach stderr; `RUST_LOG` sets the level
//! (default `warn`).

/// Installs the subscriber; a second call (or one already installed) changes nothing.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
