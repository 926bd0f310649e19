//! A progress bar on stderr for checkpoint loads, one per model, shown only at a terminal.

/// A progress bar on stderr for each checkpoint load (shown only at a terminal).
pub fn progress_bar() -> impl Fn(&str, stageload::checkpoint::Progress) + Send + Sync {
    let bar: std::sync::Mutex<Option<(String, indicatif::ProgressBar)>> = std::sync::Mutex::new(None);
    move |model, progress| {
        let mut current = stageload_trace::sync::lock(&bar);
        if current.as_ref().is_none_or(|(name, _)| name != model) {
            let new = indicatif::ProgressBar::new(progress.total).with_message(format!("loading {model}"));
            new.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg:<28} {bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            *current = Some((model.to_string(), new));
        }
        if let Some((_, bar)) = current.as_ref() {
            bar.set_position(progress.done);
            if progress.done >= progress.total {
                bar.finish_and_clear();
                *current = None;
            }
        }
    }
}
