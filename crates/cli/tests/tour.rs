//! The command line teaches: `stageload` alone prints a tour of every command, and each
//! command's `--help` ends with an example of it.

use std::process::Command;

const STAGELOAD: &str = env!("CARGO_BIN_EXE_stageload");
const COMMANDS: [&str; 9] = ["guard", "run", "queue", "plan", "summary", "plot", "ab", "latents", "libtorch"];

fn stdout(args: &[&str]) -> String {
    let out = Command::new(STAGELOAD).args(args).output().unwrap();
    assert!(out.status.success(), "stageload {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn stageload_with_no_arguments_prints_a_tour_with_a_line_for_every_command() {
    let tour = stdout(&[]);
    for command in COMMANDS {
        let line = format!("\n  stageload {command} ");
        assert!(tour.contains(&line), "the tour has no line for {command}:\n{tour}");
    }
    assert!(tour.contains("--help") && tour.lines().count() < 20, "short, and says where to read more:\n{tour}");
}

#[test]
fn every_commands_help_ends_with_an_example_of_that_command() {
    for command in COMMANDS {
        let help = stdout(&[command, "--help"]);
        let lines: Vec<&str> = help.trim_end().lines().collect();
        let example = lines.iter().rposition(|line| *line == "Example:").unwrap_or_else(|| panic!("{help}"));
        let shown = lines[example + 1..].join(" ");
        assert!(shown.trim_start().starts_with(&format!("stageload {command}")), "{command}: {help}");
    }
}
