//! `stageload summary TRACE...` and `stageload plot TRACE... -o FILE`: what a recorded run's
//! memory did, as tables (one per trace, and side by side for several) or as a chart.

use std::path::PathBuf;

use crate::out;
use clap::Args;
use stageload_trace::{plot, read_trace, summarize, table, Summary, Trace};

/// Summarize traces: overall peak, per-stage windows and peaks, loads, releases, swap, errors;
/// several traces also side by side (the first is the base of the differences).
#[derive(Args)]
#[command(
    after_help = "Exit codes: 0 done; 2 a trace is missing, broken inside, or of a newer schema.\n\nExample:\n  stageload summary eager.jsonl staged.jsonl"
)]
pub struct SummaryArgs {
    /// JSONL traces written by the meter
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Print the summaries as JSON (a list, one per trace)
    #[arg(long)]
    json: bool,
    /// Write each stage's working memory (peak minus resident weights), as the first trace
    /// measured it, into this pipeline file (its other lines kept as they are)
    #[arg(long, value_name = "PIPELINE.toml")]
    write_working: Option<PathBuf>,
}

/// Draw memory over time (one panel per trace, stage bands, load and release markers), or with
/// --bars the peak per stage (one bar per mode at its median over the traces of that mode,
/// whiskers min to max; a trace's mode is its `mode` meta field, else its file name).
#[derive(Args)]
#[command(
    after_help = "Exit codes: 0 done; 2 a trace cannot be read or the chart cannot be written.\n\nExample:\n  stageload plot eager.jsonl staged.jsonl -o memory.svg"
)]
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
    if let Some(file) = &args.write_working {
        if let Err(error) = write_working(file, &loaded[0].0) {
            eprintln!("stageload summary: --write-working {}: {error}", file.display());
            return 2;
        }
        out::line(&format!("wrote the working memory {} measured into {}", loaded[0].0.path.display(), file.display()));
    }
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

/// Writes the working memory `trace` measured for each stage occurrence into the pipeline file
/// at `file`, editing only those fields.
fn write_working(file: &std::path::Path, trace: &Trace) -> Result<(), String> {
    let text =
        stageload_input::read_text(file, stageload_plan::pipeline::MAX_PIPELINE_FILE).map_err(|e| e.to_string())?;
    let pipeline = stageload_plan::Pipeline::parse(&text, file).map_err(|e| e.to_string())?;
    let measured = stageload_plan::measured::Measured::from_trace(&pipeline, trace).map_err(|e| e.to_string())?;
    let mut document: toml_edit::DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| e.to_string())?;
    let stages =
        document.get_mut("stages").and_then(|s| s.as_array_of_tables_mut()).ok_or("the file has no [[stages]]")?;
    for (table, working) in stages.iter_mut().zip(&measured.working) {
        let Some(working) = working else { continue };
        table["working"] = toml_edit::value(working.host.to_string());
        if let Some(device) = working.device {
            table["device_working"] = toml_edit::value(device.to_string());
        }
    }
    std::fs::write(file, document.to_string()).map_err(|e| e.to_string())
}
