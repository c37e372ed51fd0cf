//! The `clickagg` binary: parse flags, load settings, set up logs, run a command.

use std::process::ExitCode;

use clap::Parser;
use clickagg::commands::cli::Cli;
use clickagg::config::Settings;
use clickagg::{commands, telemetry};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref(), cli.common.overrides()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("clickagg: {e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init_logs(&settings.log);
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
