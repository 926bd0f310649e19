//! `stageload summary TRACE...` and `stageload plot TRACE... -o FILE`: what a recorded run's
//! memory did, as tables (one per trace, and side by side for several) or as a chart.

use std::path::PathBuf;

use crate::out;
use clap::Args;
use stageload_trace::{plot, read_trace, summarize, table, Summary, Trace};

/// Summarize traces: overall peak, per-stage windows and peaks, loads, releases, swap, errors;
/// several traces also side by side (the first is the base of the differences).
#[derive(Args)]
#[command(after_help = "Exit codes: 0 done; 2 a trace is missing, broken inside, or of a newer schema.")]
pub struct SummaryArgs {
    /// JSONL traces written by the meter
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Print the summaries as JSON (a list, one per trace)
    #[arg(long)]
    json: bool,
}

/// Draw memory over time (one panel per trace, stage bands, load and release markers), or with
/// --bars the peak per stage (one bar per mode at its median over the traces of that mode,
/// whiskers min to max; a trace's mode is its `mode` meta field, else its file name).
#[derive(Args)]
#[command(after_help = "Exit codes: 0 done; 2 a trace cannot be read or the chart cannot be written.")]
pub struct PlotArgs {
    /// JSONL traces written by the meter (one panel each)
    #[arg(required = true, num_args = 1..=plot::MAX_TRACES)]
    traces: Vec<PathBuf>,
    /// The chart: FILE.svg or FILE.png
    #[arg(short, long, value_name = "FILE")]
    output: PathBuf,
    /// The peak per stage as bars, the traces grouped by mode
    #[arg(long)]
    bars: bool,
    /// Width in pixels (200 to 8000)
    #[arg(long, default_value_t = 1200, value_parser = clap::value_parser!(u32).range(*plot::WIDTHS.start() as i64..=*plot::WIDTHS.end() as i64))]
    width: u32,
}

/// Reads and summarizes `paths`; on the first that cannot be read, says so for `command`.
fn load(command: &str, paths: &[PathBuf]) -> Option<Vec<(Trace, Summary)>> {
    let loaded: Result<Vec<_>, _> = paths
        .iter()
        .map(|path| {
            let trace = read_trace(path)?;
            let summary = summarize(&trace);
            Ok((trace, summary))
        })
        .collect();
    loaded.map_err(|error: stageload_trace::TraceError| eprintln!("stageload {command}: {error}")).ok()
}

pub fn summary(args: SummaryArgs) -> i32 {
    let Some(loaded) = load("summary", &args.traces) else {
        return 2;
    };
    if args.json {
        let summaries: Vec<&Summary> = loaded.iter().map(|(_, s)| s).collect();
        out::line(&serde_json::to_string_pretty(&summaries).expect("summaries are plain data"));
        return 0;
    }
    for (trace, summary) in &loaded {
        out::line(&table::render(summary, &trace.path));
    }
    if loaded.len() > 1 {
        let labelled: Vec<(String, &Summary)> = loaded.iter().map(|(t, s)| (table::label(s, &t.path), s)).collect();
        out::line(&format!("side by side (peak per stage):\n{}", table::compare(&labelled)));
    }
    if let [(_, eager), (_, staged)] = loaded.as_slice() {
        let checks = table::against_eager(eager, staged);
        if !checks.is_empty() {
            out::line(&format!(
                "second against first, per stage (expected = its own weights + the working memory the first run shows;\n\
                 ratio = peak / expected, at most 1.05 when nothing is left over from earlier stages):\n{}",
                table::render_checks(&checks)
            ));
        }
    }
    0
}

pub fn plot(args: PlotArgs) -> i32 {
    let Some(loaded) = load("plot", &args.traces) else {
        return 2;
    };
    let traces: Vec<(String, &Trace, &Summary)> =
        loaded.iter().map(|(t, s)| (table::label(s, &t.path), t, s)).collect();
    let drawn = if args.bars {
        let mut groups: Vec<(String, Vec<&Summary>)> = Vec::new();
        for (label, _, summary) in &traces {
            match groups.iter_mut().find(|(l, _)| l == label) {
                Some((_, runs)) => runs.push(summary),
                None => groups.push((label.clone(), vec![summary])),
            }
        }
        plot::bars(&groups, &args.output, args.width)
    } else {
        plot::plot(&traces, &args.output, args.width)
    };
    match drawn {
        Ok(()) => {
            out::line(&format!("wrote {}", args.output.display()));
            0
        }
        Err(error) => {
            eprintln!("stageload plot: {error}");
            2
        }
    }
}
