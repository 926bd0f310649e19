//! Charts with `plotters`, SVG or PNG by the file's extension: memory over time ([`plot`]: one
//! panel per trace on shared axes, the RSS line, each stage as a band with its name, load (▲)
//! and release (×) markers) and the peak per stage ([`bars`]: one bar per mode at its median
//! over the runs, whiskers from min to max). Text uses DejaVu Sans compiled in (the `dejavu` crate), so charts render
//! the same on a machine without fonts.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use thiserror::Error;

use crate::event::EventKind;
use crate::reader::Trace;
use crate::record::{Record, Sample};
use crate::summary::Summary;

/// Why a chart could not be drawn.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PlotError {
    /// The drawing backend failed.
    #[error("cannot draw {path}: {source}")]
    Draw {
        /// The chart's file.
        path: String,
        /// The backend's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The chart would be too narrow or too wide, or show too many traces or modes.
    #[error("cannot draw {path}: a chart is {} to {} pixels wide (asked {width}) and shows at most {MAX_TRACES} {what} (given {count})", WIDTHS.start(), WIDTHS.end())]
    Size {
        /// The chart's file.
        path: String,
        /// The width asked for.
        width: u32,
        /// How many traces or modes it was given.
        count: usize,
        /// `traces` or `modes`.
        what: &'static str,
    },
    /// The file name ends in neither `.svg` nor `.png`.
    #[error("{path}: give a file ending in .svg or .png")]
    Format {
        /// The file name given.
        path: String,
    },
}

const GB: f64 = (1u64 << 30) as f64;
const LINE_COLORS: [RGBColor; 4] =
    [RGBColor(196, 98, 16), RGBColor(31, 119, 180), RGBColor(44, 160, 44), RGBColor(148, 103, 189)];
const BAND: RGBColor = RGBColor(235, 235, 235);

fn register_font() {
    static FONT: Once = Once::new();
    FONT.call_once(|| {
        // The bundled font is valid TrueType; were it not, text would be missing, not the chart.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// The widths a chart may have, in pixels.
pub const WIDTHS: std::ops::RangeInclusive<u32> = 200..=8000;
/// The most traces one chart shows (a panel of 300 pixels each).
pub const MAX_TRACES: usize = 16;

/// Draws `traces` (with their summaries and labels) into `path` (.svg or .png), `width` pixels
/// wide (within [`WIDTHS`]) and 300 pixels per panel (at most [`MAX_TRACES`] panels).
pub fn plot(traces: &[(String, &Trace, &Summary)], path: &Path, width: u32) -> Result<(), PlotError> {
    prepare(path, width, traces.len(), "traces")?;
    let size = (width, 300 * traces.len().max(1) as u32 + 40);
    render(path, size, |root| draw(root, traces), |root| draw(root, traces))
}

/// Registers the font and checks the chart's width and how many `what` it shows.
fn prepare(path: &Path, width: u32, count: usize, what: &'static str) -> Result<(), PlotError> {
    register_font();
    if WIDTHS.contains(&width) && count <= MAX_TRACES {
        return Ok(());
    }
    Err(PlotError::Size { path: path.display().to_string(), width, count, what })
}

/// A drawing's outcome on backend `DB`.
type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// Draws with `svg` or `png` by `path`'s extension (the two closures are the same drawing, once
/// per backend type).
fn render(
    path: &Path,
    size: (u32, u32),
    svg: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Drawn<SVGBackend<'static>>,
    png: impl FnOnce(&DrawingArea<BitMapBackend, Shift>) -> Drawn<BitMapBackend<'static>>,
) -> Result<(), PlotError> {
    let name = path.display().to_string();
    let draw_error = |source: Box<dyn std::error::Error + Send + Sync>| PlotError::Draw { path: name.clone(), source };
    match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("svg") => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            svg(&root).map_err(|e| draw_error(e.into()))?;
            root.present().map_err(|e| draw_error(e.into()))
        }
        Some("png") => {
            let root = BitMapBackend::new(path, size).into_drawing_area();
            png(&root).map_err(|e| draw_error(e.into()))?;
            root.present().map_err(|e| draw_error(e.into()))
        }
        _ => Err(PlotError::Format { path: name }),
    }
}

/// The peak per stage, one bar per mode (`groups`: a mode's label and its runs' summaries) at the
/// median over its runs, with a whisker from the smallest to the largest run; `width` pixels
/// wide (within [`WIDTHS`]).
pub fn bars(groups: &[(String, Vec<&Summary>)], path: &Path, width: u32) -> Result<(), PlotError> {
    prepare(path, width, groups.len(), "modes")?;
    let runs: Vec<Vec<&Summary>> = groups.iter().map(|(_, runs)| runs.clone()).collect();
    let stages = crate::aggregate::aggregate(&runs);
    let labels: Vec<&str> = groups.iter().map(|(label, _)| label.as_str()).collect();
    render(path, (width, 460), |root| draw_bars(root, &stages, &labels), |root| draw_bars(root, &stages, &labels))
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    stages: &[crate::aggregate::StageSpread],
    labels: &[&str],
) -> Drawn<DB> {
    root.fill(&WHITE)?;
    // Room above the tallest whisker for the stage names and the legend.
    let top = stages.iter().flat_map(|s| s.host.iter().flatten()).map(|s| s.max as f64 / GB).fold(0.1, f64::max) * 1.3;
    let count = stages.len().max(1) as f64;
    let mut chart = ChartBuilder::on(root)
        .caption("peak per stage: median over the runs, whiskers min to max", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..count, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|_| String::new())
        .y_desc("GB")
        .label_style(("sans-serif", 12))
        .draw()?;
    // Each stage's name centred over its group of bars.
    let style = TextStyle::from(("sans-serif", 13)).pos(Pos::new(HPos::Center, VPos::Top));
    chart.draw_series(
        stages.iter().enumerate().map(|(i, s)| Text::new(s.stage.clone(), (i as f64 + 0.5, top * 0.99), style.clone())),
    )?;
    let slot = 0.8 / labels.len().max(1) as f64;
    for (mode, label) in labels.iter().enumerate() {
        let color = LINE_COLORS[mode % LINE_COLORS.len()];
        let spreads: Vec<(f64, crate::aggregate::Spread)> = stages
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i as f64 + 0.1 + slot * mode as f64, s.host.get(mode).copied().flatten()?)))
            .collect();
        let gb = |bytes: u64| bytes as f64 / GB;
        chart
            .draw_series(
                spreads
                    .iter()
                    .map(|(x, s)| Rectangle::new([(*x, 0.0), (*x + slot * 0.9, gb(s.median))], color.filled())),
            )?
            .label(label.to_string())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        chart.draw_series(spreads.iter().map(|(x, s)| {
            let middle = *x + slot * 0.45;
            PathElement::new(vec![(middle, gb(s.min)), (middle, gb(s.max))], BLACK.stroke_width(2))
        }))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 12))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::Coordinate(8, 26))
        .draw()?;
    Ok(())
}

/// (seconds, GB) of one reading over the trace's samples, where the sample has it.
fn series(trace: &Trace, reading: impl Fn(&Sample) -> Option<u64>) -> Vec<(f64, f64)> {
    trace
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Sample(s) => reading(s).map(|bytes| (s.t, bytes as f64 / GB)),
            _ => None,
        })
        .collect()
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, traces: &[(String, &Trace, &Summary)]) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let root = root.titled("memory over time (host RSS; device allocated, dashed)", ("sans-serif", 20))?;
    let max_t = traces.iter().map(|(_, _, s)| s.stages.last().map_or(0.0, |w| w.start + w.seconds)).fold(1.0, f64::max);
    let max_gb =
        traces.iter().map(|(_, _, s)| s.peak.max(s.device_allocated_peak.unwrap_or(0)) as f64 / GB).fold(0.1, f64::max)
            * 1.15;
    for (index, ((label, trace, summary), panel)) in
        traces.iter().zip(root.split_evenly((traces.len().max(1), 1))).enumerate()
    {
        let color = LINE_COLORS[index % LINE_COLORS.len()];
        let caption = format!(
            "{label}: peak {:.2} GB{}",
            summary.peak as f64 / GB,
            if summary.complete { "" } else { ", stopped (no end record)" }
        );
        let mut chart = ChartBuilder::on(&panel)
            .caption(caption, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(32)
            .y_label_area_size(52)
            .build_cartesian_2d(0.0..max_t, 0.0..max_gb)?;
        chart.configure_mesh().disable_mesh().x_desc("seconds").y_desc("GB").label_style(("sans-serif", 12)).draw()?;
        // Stage bands, alternating, with their names at the top.
        for (i, window) in summary.stages.iter().enumerate() {
            let (start, end) = (window.start, window.start + window.seconds);
            if i % 2 == 1 {
                chart.draw_series(std::iter::once(Rectangle::new([(start, 0.0), (end, max_gb)], BAND.filled())))?;
            }
            chart.draw_series(std::iter::once(Text::new(
                window.stage.clone(),
                (start, max_gb * 0.97),
                ("sans-serif", 11),
            )))?;
        }
        let points = series(trace, |s| s.rss);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
        // Device memory (CUDA allocated), where the run sampled it: dashes along the samples.
        let device = series(trace, |s| s.device_allocated);
        if !device.is_empty() {
            chart
                .draw_series(DashedLineSeries::new(device.iter().copied(), 6, 4, color.mix(0.7).stroke_width(2)))?
                .label(format!("{label} (device)"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.mix(0.7).stroke_width(2)));
        }
        // The RSS just after an event, for placing its marker on the line (points are in time order).
        let level_at = |t: f64| {
            let next = points.partition_point(|(pt, _)| *pt < t);
            points.get(next).or(points.last()).map_or(0.0, |(_, gb)| *gb)
        };
        for record in &trace.records {
            if let Record::Event(event) = record {
                let at = (event.t, level_at(event.t));
                match event.kind() {
                    EventKind::Load | EventKind::Reload => {
                        chart.draw_series(std::iter::once(TriangleMarker::new(at, 6, color.filled())))?;
                    }
                    EventKind::Release => {
                        chart.draw_series(std::iter::once(Cross::new(at, 5, BLACK.stroke_width(2))))?;
                    }
                    _ => {}
                }
            }
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 12))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
    }
    Ok(())
}
