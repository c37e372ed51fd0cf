//! The `clickagg` binary: parse flags, load settings, set up logs, run a command.

use std::process::ExitCode;

use clap::Parser;
use clickagg::commands;
use clickagg::commands::cli::Cli;
use clickagg::config::{LogFormat, LogSettings, Settings};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref(), cli.common.overrides()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("clickagg: {e}");
            return ExitCode::from(2);
        }
    };
    init_logs(&settings.log);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    // Spawned, not run on the main thread: rebalance callbacks block a worker thread
    // (`block_in_place`) to flush, which needs a multi-thread runtime worker.
    let result = runtime.block_on(async { tokio::spawn(commands::dispatch(cli.command, settings)).await });
    match result {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            eprintln!("clickagg: {e:#}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("clickagg: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Installs the tracing subscriber: `RUST_LOG` if set, else the configured filter.
fn init_logs(settings: &LogSettings) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&settings.filter))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // Fails only when a subscriber is set already, which then stays.
    let _ = match settings.format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
}
