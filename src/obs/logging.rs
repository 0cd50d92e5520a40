//! Logging for the daemons.

/// Logging for the daemons, set up in one place: stderr, level from `NODEPLANE_LOG`
/// (default info), JSON or text, colours only on a terminal.
pub fn init_logging(json: bool) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("NODEPLANE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
