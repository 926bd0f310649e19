//! A newcomer's check of the front door (issue 45): `README.md` stays under its line budget, every
//! relative link in it and in the guide (`docs/*.md`) leads to a file or folder of the checkout,
//! every `cargo xtask TASK` and `stageload COMMAND` they show is one that exists, and every code
//! block in them is compiled by the test command (see [`Language`]): Rust by rustdoc, which
//! compiles each document as the library's doc-tests (`crates/torch/src/lib.rs`, module `guide`),
//! a pipeline description by the reader `stageload plan` uses, Python by Python.
//!
//! And the house around it (issue 72): each row of the README's measured table is one short
//! claim with its figure ([`CLAIM_BUDGET`]) and a link to the run behind it; `traces/` holds
//! results and no source files (the programs behind them are in `crates/bench/`), and its index,
//! `traces/README.md`, links every entry of it, by links that resolve; `docs/layout.md`'s tree
//! names every top-level folder, crate, example and test file of the checkout and each crate's
//! top-level modules (`crates/*/src`), and nothing that is not there; and the README, the guide
//! and the traces' index hold no words of a lab notebook or a commit ([`PROCESS_PHRASES`]).
//!
//! The tasks and commands are read from the clap definitions, as text: the `#[derive(Parser)]`
//! struct of `crates/xtask/src` and of `crates/cli/src`, its `#[command(subcommand)]` field's
//! enum, and that enum's variants in kebab case (clap's default), a `#[command(name = ...)]` or
//! alias on a variant taken as written. Commands are looked for in code only (inline code spans
//! and fenced `sh` blocks), where a word after `stageload` is a command and not prose; links in
//! the prose only.
//!
//! Torch-free, though it is a test of the `stageload` package: it reads files, writes checkpoint
//! headers into a temporary folder, and runs Python only to compile the Python blocks.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The most lines `README.md` may have.
const README_BUDGET: usize = 300;

/// The most characters a row of the README's measured table may have before its last cell (what
/// is measured and the figure): one claim (the run's conditions, dates and earlier figures belong
/// in the trace's own README, which the last cell links to).
const CLAIM_BUDGET: usize = 200;

/// The heading of the README's measured table.
const MEASURED_HEADING: &str = "## What it is measured to do";

/// File extensions that are source code, not results: none may live under `traces/`.
const SOURCE_EXTENSIONS: [&str; 9] = ["c", "h", "cc", "cpp", "py", "sh", "rs", "patch", "diff"];

/// Words of a lab notebook or a commit message, which a reader of the README and the guide cannot
/// act on: who was lent which machine in which working session, an issue's number (the guide says
/// what is so, not which ticket asked for it), and unfinished work (it belongs in an issue). Each
/// is matched as whole words, case-insensitive, except the markers, which only count in capitals
/// (`xxx` may stand for digits in a file name).
const PROCESS_PHRASES: [&str; 6] =
    ["was lent", "were lent", "this session", "the session that", "this work", "the issue's"];

/// Markers of unfinished work, matched as whole words in capitals.
const PROCESS_MARKERS: [&str; 3] = ["TODO", "FIXME", "XXX"];

/// The languages of fenced blocks whose lines are commands.
const SHELL: [&str; 4] = ["sh", "bash", "shell", "console"];

/// What a fenced block may be marked as, and what compiles or checks it. A block with no language
/// is refused: rustdoc would compile it as Rust, and a reader cannot tell what it is.
#[derive(Debug, PartialEq)]
enum Language {
    /// Compiled by rustdoc as a doc-test of the library (`no_run` where it needs files: type-checked,
    /// not linked). `ignore` only for the build script, which must be the user-crate template's
    /// `build.rs` as it is (compiled and run by `crates/build-support/tests/user_crate.rs`: a
    /// doc-test cannot reach `stageload-build`).
    Rust,
    /// Commands: each `cargo xtask TASK` and `stageload COMMAND` must exist.
    Shell,
    /// A pipeline description (read by `stageload_plan::Pipeline::parse`, checkpoints given) or a
    /// manifest fragment (the user-crate template's dependency lines, as they are).
    Toml,
    /// Compiled by Python's `compile`.
    Python,
    /// Output or a folder tree: nothing to compile.
    Text,
}

impl Language {
    /// The language of a fence's info string (`rust,no_run` → Rust), `None` for none or another.
    fn of(info: &str) -> Option<Language> {
        let first = info.split([',', ' ']).next().unwrap_or("");
        match first {
            "rust" => Some(Language::Rust),
            "toml" => Some(Language::Toml),
            "python" => Some(Language::Python),
            "text" => Some(Language::Text),
            _ if SHELL.contains(&first) => Some(Language::Shell),
            _ => None,
        }
    }
}

/// A fenced block: its info string (`rust,no_run`), the line it opens on (from 1), its text.
#[derive(Debug)]
struct Block {
    info: String,
    line: usize,
    text: String,
}

fn checkout() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `README.md` and every `docs/*.md`, as (path relative to the checkout, text).
fn documents() -> Vec<(PathBuf, String)> {
    let root = checkout();
    let mut paths = vec![PathBuf::from("README.md")];
    let mut guide: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("docs/ (the guide) is missing")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .map(|path| path.strip_prefix(&root).unwrap().to_path_buf())
        .collect();
    guide.sort();
    assert!(guide.contains(&PathBuf::from("docs/README.md")), "docs/README.md (the guide's index) is missing");
    paths.extend(guide);
    paths
        .into_iter()
        .map(|path| {
            let text = fs::read_to_string(root.join(&path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, text)
        })
        .collect()
}

/// A markdown text split into its prose (code spans and fenced blocks blanked out) and the code
/// that may name commands: each inline span, and each line of a fenced block marked as shell
/// (`sh`, `bash`, `shell`, `console`); a block of another language or none (a folder tree, say)
/// is read as neither.
struct Split {
    prose: String,
    code: Vec<String>,
    blocks: Vec<Block>,
}

fn split(text: &str) -> Split {
    let mut prose = String::new();
    let mut code = Vec::new();
    let mut blocks: Vec<Block> = Vec::new();
    let mut fence: Option<(String, bool)> = None;
    let mut paragraph = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker: String = trimmed.chars().take_while(|&c| c == '`' || c == '~').collect();
        match &fence {
            Some((open, _)) if trimmed.starts_with(open.as_str()) && trimmed.trim_end() == marker => fence = None,
            Some((_, shell)) => {
                if *shell {
                    code.push(line.to_string());
                }
                let block = blocks.last_mut().unwrap();
                block.text.push_str(line);
                block.text.push('\n');
            }
            None if marker.len() >= 3 && marker.chars().all(|c| c == marker.chars().next().unwrap()) => {
                flush(&mut paragraph, &mut prose, &mut code);
                let info = trimmed[marker.len()..].trim();
                blocks.push(Block { info: info.to_string(), line: number + 1, text: String::new() });
                fence = Some((marker, Language::of(info) == Some(Language::Shell)));
            }
            None if trimmed.is_empty() => flush(&mut paragraph, &mut prose, &mut code),
            None => paragraph.push(line.to_string()),
        }
    }
    flush(&mut paragraph, &mut prose, &mut code);
    Split { prose, code, blocks }
}

/// One paragraph of prose: its inline code spans (which may run over lines) go to `code`, the
/// rest to `prose`.
fn flush(paragraph: &mut Vec<String>, prose: &mut String, code: &mut Vec<String>) {
    let text = paragraph.join("\n");
    paragraph.clear();
    let mut rest = text.as_str();
    while let Some(start) = rest.find('`') {
        let ticks = rest[start..].chars().take_while(|&c| c == '`').count();
        let after = &rest[start + ticks..];
        let closing = find_run(after, ticks);
        prose.push_str(&rest[..start]);
        match closing {
            Some(end) => {
                code.push(after[..end].replace('\n', " "));
                prose.push(' ');
                rest = &after[end + ticks..];
            }
            None => {
                // An unmatched run of backticks is literal text.
                prose.push_str(&rest[start..start + ticks]);
                rest = after;
            }
        }
    }
    prose.push_str(rest);
    prose.push('\n');
}

/// Where a run of exactly `ticks` backticks begins in `text`.
fn find_run(text: &str, ticks: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'`' {
            let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
            if run == ticks {
                return Some(i);
            }
            i += run;
        } else {
            i += 1;
        }
    }
    None
}

/// The targets of the inline links and images (`[text](target)`, `![alt](target)`) and of the
/// reference definitions (`[name]: target`) in `prose`.
fn link_targets(prose: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = prose;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let target = after[..end].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_start_matches('<').trim_end_matches('>').to_string());
        rest = &after[end..];
    }
    for line in prose.lines() {
        let line = line.trim_start();
        if let Some(close) = line.strip_prefix('[').and_then(|l| l.find("]:")) {
            let target = line[close + 3..].split_whitespace().next().unwrap_or("");
            targets.push(target.trim_start_matches('<').trim_end_matches('>').to_string());
        }
    }
    targets
}

/// The path a relative link points at, `#fragment` stripped; `None` for web links, mail and
/// links within the page.
fn relative_path(target: &str) -> Option<&str> {
    let external = ["http://", "https://", "mailto:"].iter().any(|scheme| target.starts_with(scheme));
    let path = target.split('#').next().unwrap_or("");
    (!external && !path.is_empty()).then_some(path)
}

/// `base/target` with `.` and `..` worked out, or `None` when it climbs out of the checkout.
fn resolve(base: &Path, target: &str) -> Option<PathBuf> {
    let joined = base.join(target);
    let mut parts: Vec<Component> = Vec::new();
    for component in joined.components() {
        match component {
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return None,
            Component::ParentDir => {
                parts.pop()?;
            }
            other => parts.push(other),
        }
    }
    Some(parts.iter().collect())
}

/// The word after `first second` in `code` (`cargo xtask demo` → `demo`), for each time the pair
/// is followed by a word: options (`--help`) and other text are no command.
fn named_after(code: &str, first: &str, second: Option<&str>) -> Vec<String> {
    let words: Vec<&str> = code.split_whitespace().collect();
    let width = if second.is_some() { 2 } else { 1 };
    let mut named = Vec::new();
    for (i, word) in words.iter().enumerate() {
        if *word != first || second.is_some_and(|s| words.get(i + 1) != Some(&s)) {
            continue;
        }
        if let Some(next) = words.get(i + width) {
            let command = next.trim_end_matches([',', ';', ')', '.', ':']);
            let first_char = command.chars().next().unwrap_or(' ');
            if first_char.is_ascii_lowercase() && command.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                named.push(command.to_string());
            }
        }
    }
    named
}

/// `HotSetBench` → `hot-set-bench`, as clap names a subcommand by default.
fn kebab(ident: &str) -> String {
    let mut out = String::new();
    for (i, c) in ident.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else if c == '_' {
            out.push('-');
        } else {
            out.push(c);
        }
    }
    out
}

/// The quoted values of `key = "..."` in an attribute.
fn attribute_values(attribute: &str, keys: &[&str]) -> Vec<String> {
    let mut values = Vec::new();
    for part in attribute.split(',') {
        let Some((key, value)) = part.split_once('=') else { continue };
        let key = key.trim().trim_start_matches("#[command(");
        if keys.contains(&key) {
            if let Some(value) = value.trim().strip_prefix('"').and_then(|v| v.split('"').next()) {
                values.push(value.to_string());
            }
        }
    }
    values
}

/// The subcommands of the enum `name` declared in `source`, or `None` when `source` does not
/// declare it.
fn enum_subcommands(source: &str, name: &str) -> Option<BTreeSet<String>> {
    let start = source.find(&format!("enum {name} {{")).or_else(|| source.find(&format!("enum {name}{{")))?;
    let body = &source[start + source[start..].find('{')?..];
    let mut names = BTreeSet::new();
    let mut renamed = None;
    let mut depth = 0usize;
    for line in body.lines() {
        let line = line.trim();
        if line.starts_with("//") {
            continue;
        }
        if depth == 1 {
            if line.starts_with("#[command(") {
                renamed = attribute_values(line, &["name"]).pop().or(renamed);
                names.extend(attribute_values(line, &["alias", "visible_alias"]));
            } else if line.starts_with(|c: char| c.is_ascii_uppercase()) {
                let ident: String = line.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                names.insert(renamed.take().unwrap_or_else(|| kebab(&ident)));
            }
        }
        for c in line.chars() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
        }
        if depth == 0 {
            break;
        }
    }
    Some(names)
}

/// The top-level subcommands of the binary whose sources are in `src`: the enum of the
/// `#[command(subcommand)]` field of its `#[derive(Parser)]` struct, plus clap's own `help`.
fn subcommands(src: &str) -> BTreeSet<String> {
    let mut sources = Vec::new();
    let mut folders = vec![checkout().join(src)];
    while let Some(folder) = folders.pop() {
        for entry in fs::read_dir(&folder).unwrap_or_else(|e| panic!("{}: {e}", folder.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                sources.push(fs::read_to_string(&path).unwrap());
            }
        }
    }
    // The struct after a `#[derive(Parser)]`, up to its closing brace, that has a subcommand field.
    let field = sources
        .iter()
        .flat_map(|source| source.match_indices("#[derive(Parser)]").map(move |(at, _)| &source[at..]))
        .map(|parser| &parser[..parser.find("\n}").unwrap_or(parser.len())])
        .find_map(|parser| parser.find("#[command(subcommand)]").map(|at| &parser[at..]))
        .unwrap_or_else(|| panic!("{src}: no #[derive(Parser)] struct with a #[command(subcommand)] field"));
    let declaration = field
        .lines()
        .skip(1)
        .map(str::trim)
        .find(|line| !line.is_empty() && !line.starts_with("//") && !line.starts_with("#["))
        .unwrap_or_default();
    let type_name = declaration
        .split_once(':')
        .map(|(_, ty)| ty.trim().trim_end_matches(',').trim())
        .map(|ty| ty.strip_prefix("Option<").and_then(|t| t.strip_suffix('>')).unwrap_or(ty))
        .unwrap_or_else(|| panic!("{src}: cannot read the subcommand field `{declaration}`"));
    let mut names = sources
        .iter()
        .find_map(|source| enum_subcommands(source, type_name))
        .unwrap_or_else(|| panic!("{src}: enum {type_name} not found"));
    names.insert("help".to_string());
    names
}

/// Every `first [second] WORD` the documents show in their code, as (document, word).
fn named_in_documents(first: &str, second: Option<&str>) -> Vec<(PathBuf, String)> {
    let mut named = Vec::new();
    for (path, text) in documents() {
        for code in split(&text).code {
            named.extend(named_after(&code, first, second).into_iter().map(|word| (path.clone(), word)));
        }
    }
    named
}

fn unknown_commands(first: &str, second: Option<&str>, src: &str) -> (usize, Vec<String>) {
    let known = subcommands(src);
    let named = named_in_documents(first, second);
    let shown = [Some(first), second].into_iter().flatten().collect::<Vec<_>>().join(" ");
    let unknown = named
        .iter()
        .filter(|(_, word)| !known.contains(word))
        .map(|(path, word)| format!("{}: `{shown} {word}` (known: {known:?})", path.display()))
        .collect();
    (named.len(), unknown)
}

#[test]
fn the_readme_stays_under_its_line_budget() {
    let readme = fs::read_to_string(checkout().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= README_BUDGET,
        "README.md has {lines} lines, over its budget of {README_BUDGET}: move the depth to docs/"
    );
}

#[test]
fn every_relative_link_in_the_readme_and_the_guide_resolves() {
    let root = checkout();
    let mut checked = 0;
    let mut broken = Vec::new();
    for (path, text) in documents() {
        let base = path.parent().unwrap_or(Path::new(""));
        for target in link_targets(&split(&text).prose) {
            let Some(relative) = relative_path(&target) else { continue };
            checked += 1;
            match resolve(base, relative) {
                Some(resolved) if root.join(&resolved).exists() => {}
                Some(resolved) => {
                    broken.push(format!("{}: `{target}` ({} does not exist)", path.display(), resolved.display()))
                }
                None => broken.push(format!("{}: `{target}` leads out of the checkout", path.display())),
            }
        }
    }
    assert!(checked > 0, "no relative link found: the link reader is broken");
    assert!(broken.is_empty(), "links that do not resolve:\n{}", broken.join("\n"));
}

#[test]
fn every_cargo_xtask_task_the_docs_name_exists() {
    let (named, unknown) = unknown_commands("cargo", Some("xtask"), "crates/xtask/src");
    assert!(named > 0, "no `cargo xtask TASK` found in README.md or docs/: the reader is broken");
    assert!(unknown.is_empty(), "tasks that do not exist:\n{}", unknown.join("\n"));
}

#[test]
fn every_stageload_command_the_docs_name_exists() {
    let (named, unknown) = unknown_commands("stageload", None, "crates/cli/src");
    assert!(named > 0, "no `stageload COMMAND` found in README.md or docs/: the reader is broken");
    assert!(unknown.is_empty(), "commands that do not exist:\n{}", unknown.join("\n"));
}

#[test]
fn the_task_and_command_lists_are_read_from_the_clap_definitions() {
    let tasks = subcommands("crates/xtask/src");
    for task in ["test", "demo", "example", "stream-demo", "hot-set-bench", "gpu-check"] {
        assert!(tasks.contains(task), "`cargo xtask {task}` not read from the clap definitions: {tasks:?}");
    }
    assert!(!tasks.contains("build"), "a nested subcommand was read as a task: {tasks:?}");
    let commands = subcommands("crates/cli/src");
    for command in ["guard", "plan", "summary", "plot", "ab", "latents", "libtorch"] {
        assert!(commands.contains(command), "`stageload {command}` not read from the clap definitions: {commands:?}");
    }
}

/// The cells of a markdown table row (`| a | b |` → `["a", "b"]`), trimmed; a `|` inside a code
/// span or escaped (`\|`) does not end a cell.
fn table_cells(row: &str) -> Vec<String> {
    let inner = row.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let (mut cells, mut cell, mut in_code, mut escaped) = (Vec::new(), String::new(), false, false);
    for c in inner.chars() {
        match c {
            '|' if !in_code && !escaped => cells.push(std::mem::take(&mut cell).trim().to_string()),
            '`' => {
                in_code = !in_code;
                cell.push(c);
            }
            _ => cell.push(c),
        }
        escaped = c == '\\';
    }
    cells.push(cell.trim().to_string());
    cells
}

/// The rows of the first table after `heading` in `text` (header and delimiter row left out), as
/// (line number from 1, cells).
fn table_after(text: &str, heading: &str) -> Vec<(usize, Vec<String>)> {
    let lines: Vec<&str> = text.lines().collect();
    let Some(start) = lines.iter().position(|line| line.trim_end() == heading) else { return Vec::new() };
    let rows = lines.iter().enumerate().skip(start + 1).skip_while(|(_, line)| !line.starts_with('|'));
    rows.take_while(|(_, line)| line.starts_with('|'))
        .skip(2)
        .map(|(number, line)| (number + 1, table_cells(line)))
        .collect()
}

#[test]
fn every_row_of_the_readmes_measured_table_is_one_short_claim_with_a_link_to_its_run() {
    let readme = fs::read_to_string(checkout().join("README.md")).unwrap();
    let rows = table_after(&readme, MEASURED_HEADING);
    assert!(rows.len() >= 10, "README.md: {} rows found under `{MEASURED_HEADING}`: the reader is broken", rows.len());
    let mut wrong = Vec::new();
    for (line, cells) in &rows {
        let Some((record, claim)) = cells.split_last() else { continue };
        let length: usize = claim.iter().map(|cell| cell.chars().count()).sum();
        if claim.is_empty() || length > CLAIM_BUDGET {
            wrong.push(format!("README.md:{line}: a claim of {length} characters: {}", claim.join(" | ")));
        }
        if !record.contains("](") {
            wrong.push(format!("README.md:{line}: the last cell links to no recorded run: {record}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "rows of the measured table: one claim and its figure in at most {CLAIM_BUDGET} characters, then a \
         link to the run; the run's conditions and history go in the trace's README:\n{}",
        wrong.join("\n")
    );
}

/// Every file under `folder` (a path relative to the checkout), as paths relative to the checkout.
fn files_under(folder: &str) -> Vec<PathBuf> {
    let root = checkout();
    let mut files = Vec::new();
    let mut folders = vec![root.join(folder)];
    while let Some(folder) = folders.pop() {
        for entry in fs::read_dir(&folder).unwrap_or_else(|e| panic!("{}: {e}", folder.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else {
                files.push(path.strip_prefix(&root).unwrap().to_path_buf());
            }
        }
    }
    files.sort();
    files
}

#[test]
fn traces_hold_results_and_no_source_files() {
    let files = files_under("traces");
    assert!(files.len() > 100, "{} files under traces/: the walk is broken", files.len());
    let sources: Vec<String> = files
        .iter()
        .filter(|path| path.extension().is_some_and(|ext| SOURCE_EXTENSIONS.iter().any(|s| ext == *s)))
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        sources.is_empty(),
        "source files under traces/: move them beside the bench binaries (crates/bench/c/, python/, \
         patches/) and point the trace's README at them:\n{}",
        sources.join("\n")
    );
}

#[test]
fn the_traces_index_links_every_entry_of_traces_and_its_links_resolve() {
    let index =
        fs::read_to_string(checkout().join("traces/README.md")).expect("traces/README.md (the index) is missing");
    let targets: Vec<String> = link_targets(&split(&index).prose);
    assert!(targets.len() > 10, "{} links read from traces/README.md: the reader is broken", targets.len());
    let mut wrong = Vec::new();
    for target in &targets {
        let Some(relative) = relative_path(target) else { continue };
        match resolve(Path::new("traces"), relative) {
            Some(resolved) if checkout().join(&resolved).exists() => {}
            _ => wrong.push(format!("the link `{target}` does not resolve")),
        }
    }
    let mut entries = names_in("traces", true, None).into_iter().map(|name| format!("{name}/")).collect::<Vec<_>>();
    let files = fs::read_dir(checkout().join("traces")).unwrap().map(|entry| entry.unwrap().path());
    entries
        .extend(files.filter(|path| path.is_file()).filter_map(|path| Some(path.file_name()?.to_str()?.to_string())));
    for entry in entries.iter().filter(|entry| *entry != "README.md") {
        if !targets.iter().any(|target| target.starts_with(entry.as_str())) {
            wrong.push(format!("`traces/{entry}` is not linked from the index"));
        }
    }
    assert!(wrong.is_empty(), "traces/README.md, the index of the recorded runs:\n{}", wrong.join("\n"));
}

/// The entries of the folder tree in `docs/layout.md` (its first `text` block): each line that
/// starts at the margin opens one, named by its first word (`crates/torch/`, `Cargo.toml`); the
/// indented lines after it are its text.
fn layout_entries() -> Vec<(String, String)> {
    let layout = fs::read_to_string(checkout().join("docs/layout.md")).unwrap();
    let tree =
        split(&layout).blocks.into_iter().find(|block| block.info == "text").expect("docs/layout.md has no tree");
    let mut entries: Vec<(String, String)> = Vec::new();
    for line in tree.text.lines() {
        match (line.starts_with(char::is_whitespace), entries.last_mut()) {
            (true, Some((_, text))) => {
                text.push('\n');
                text.push_str(line.trim());
            }
            _ => {
                let (name, text) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
                entries.push((name.to_string(), text.trim().to_string()));
            }
        }
    }
    entries
}

/// The names of the folders (`folders`) or of the files with extension `ext`, less it, in
/// `folder` of the checkout; hidden ones and `target` left out.
fn names_in(folder: &str, folders: bool, ext: Option<&str>) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(checkout().join(folder))
        .unwrap_or_else(|e| panic!("{folder}: {e}"))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_dir() == folders)
        .filter(|path| ext.is_none_or(|ext| path.extension().is_some_and(|e| e == ext)))
        .filter_map(|path| Some(path.file_stem()?.to_str()?.to_string()))
        .filter(|name| !name.starts_with('.') && name != "target")
        .collect();
    names.sort();
    names
}

/// The top-level modules of `crates/<krate>/src`: each `NAME.rs` and each folder `NAME/`, less the
/// crate roots (`lib.rs`, `main.rs`) and `bin/` (binaries, named by the crate's entry as it likes).
fn top_level_modules(krate: &str) -> Vec<String> {
    let src = format!("crates/{krate}/src");
    if !checkout().join(&src).is_dir() {
        return Vec::new();
    }
    let mut modules = names_in(&src, false, Some("rs"));
    modules.extend(names_in(&src, true, None));
    modules.retain(|name| !["lib", "main", "bin"].contains(&name.as_str()));
    modules.sort();
    modules.dedup();
    modules
}

/// The words of `text`: runs of letters, digits and `_`.
fn words(text: &str) -> BTreeSet<&str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| !w.is_empty()).collect()
}

#[test]
fn the_layout_doc_names_every_folder_crate_module_example_and_test_of_the_tree_and_nothing_else() {
    let entries = layout_entries();
    assert!(entries.len() > 10, "{} entries read from docs/layout.md's tree: the reader is broken", entries.len());
    let named: BTreeSet<&str> = entries.iter().map(|(name, _)| name.as_str()).collect();
    let text_of =
        |name: &str| entries.iter().find(|(entry, _)| entry == name).map(|(_, text)| words(text)).unwrap_or_default();
    let mut wrong = Vec::new();
    for name in &named {
        if !checkout().join(name).exists() {
            wrong.push(format!("`{name}` is in the tree but not in the checkout"));
        }
    }
    for folder in names_in(".", true, None) {
        // A folder is named by its own entry or by entries inside it (`crates/torch/`).
        if !named.iter().any(|name| name.starts_with(&format!("{folder}/"))) {
            wrong.push(format!("the folder `{folder}/` is not in the tree"));
        }
    }
    for krate in names_in("crates", true, None) {
        if !named.contains(format!("crates/{krate}/").as_str()) {
            wrong.push(format!("the crate `crates/{krate}/` is not in the tree"));
        }
    }
    let mut within = |entry: &str, names: Vec<String>, kind: &str| {
        let text = text_of(entry);
        for name in names.iter().filter(|name| !text.contains(name.as_str())) {
            wrong.push(format!("the {kind} `{name}` is not named in `{entry}`"));
        }
    };
    for krate in names_in("crates", true, None) {
        let entry = format!("crates/{krate}/");
        if named.contains(entry.as_str()) {
            within(&entry, top_level_modules(&krate), "module");
        }
    }
    within("examples/", names_in("examples", false, Some("rs")), "example");
    within("tests/", names_in("tests", false, Some("rs")), "test file");
    within("tests/", names_in("tests", true, None), "test folder");
    assert!(wrong.is_empty(), "docs/layout.md has drifted from the tree:\n{}", wrong.join("\n"));
}

#[test]
fn table_cells_and_layout_entries_are_read_as_written() {
    assert_eq!(table_cells("| a | `x | y` b | c \\| d |"), ["a", "`x | y` b", "c \\| d"]);
    let text =
        "# T\n\n## What it is measured to do\n\nSome text:\n\n| h | i |\n|---|---|\n| a | b |\n| c | d |\n\nAfter.\n";
    let rows = table_after(text, MEASURED_HEADING);
    assert_eq!(rows, [(9, vec!["a".to_string(), "b".to_string()]), (10, vec!["c".to_string(), "d".to_string()])]);
    assert!(table_after(text, "## Elsewhere").is_empty());
    assert_eq!(
        words("two_models (the README example), cascade;"),
        BTreeSet::from(["README", "cascade", "example", "the", "two_models"])
    );
    let modules = top_level_modules("torch");
    for module in ["staged", "checkpoint", "pt2", "rng"] {
        assert!(modules.contains(&module.to_string()), "{module} not read from crates/torch/src: {modules:?}");
    }
    assert!(!modules.contains(&"lib".to_string()), "{modules:?}");
    assert!(!top_level_modules("bench").contains(&"bin".to_string()));
}

/// The process words on each line of `text`, as (line number from 1, what was found): the phrases
/// of [`PROCESS_PHRASES`] and the markers of [`PROCESS_MARKERS`] as whole words, and an issue's
/// number (`issue 72`, `issues 45 and 69`, `#72`). Web addresses are left out: a link to another
/// project's issue is a reference, not a note.
fn process_words(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let kept: Vec<&str> = line.split_whitespace().filter(|chunk| !chunk.contains("://")).collect();
        let tokens: Vec<&str> = kept
            .iter()
            .flat_map(|chunk| chunk.split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '#' || c == '_')))
            .map(|token| token.trim_matches('\''))
            .filter(|token| !token.is_empty())
            .collect();
        let lower: Vec<String> = tokens.iter().map(|token| token.to_lowercase()).collect();
        for phrase in PROCESS_PHRASES {
            let words: Vec<&str> = phrase.split(' ').collect();
            if lower.windows(words.len()).any(|window| window.iter().zip(&words).all(|(a, b)| a == b)) {
                found.push((number + 1, format!("\"{phrase}\"")));
            }
        }
        for marker in PROCESS_MARKERS {
            if tokens.contains(&marker) {
                found.push((number + 1, marker.to_string()));
            }
        }
        let is_number = |token: &str| !token.is_empty() && token.chars().all(|c| c.is_ascii_digit());
        for (i, token) in lower.iter().enumerate() {
            let numbered = (token == "issue" || token == "issues")
                && lower.get(i + 1).is_some_and(|next| is_number(next.trim_start_matches('#')));
            if numbered {
                found.push((number + 1, format!("an issue's number (`{} {}`)", tokens[i], tokens[i + 1])));
            } else if token.strip_prefix('#').is_some_and(is_number) {
                found.push((number + 1, format!("an issue's number (`{}`)", tokens[i])));
            }
        }
    }
    found
}

#[test]
fn the_readme_the_guide_and_the_traces_index_hold_no_process_words() {
    let mut found = Vec::new();
    // The traces' index too: the runs' own READMEs are their lab notebooks, the index is not.
    let index = PathBuf::from("traces/README.md");
    let index_text = fs::read_to_string(checkout().join(&index)).unwrap();
    for (path, text) in documents().into_iter().chain([(index, index_text)]) {
        found.extend(process_words(&text).into_iter().map(|(line, what)| format!("{}:{line}: {what}", path.display())));
    }
    assert!(
        found.is_empty(),
        "words of a lab notebook or a commit in the README or the guide: say what is so for the reader \
         (the run's history belongs in its trace's README, the reason for a change in its commit):\n{}",
        found.join("\n")
    );
}

#[test]
fn process_words_are_found_as_words_and_nothing_else() {
    let text = "Not run on a GPU: no device was lent to this work.\n\
                The thread issues each piece; the issue's goal.\n\
                As asked in issue 72 (and #45); see https://github.com/o/r/issues/12.\n\
                TODO: the rest. A todo list, files named 00xxx, a session of the queue, excellent.\n";
    let found: Vec<(usize, String)> = process_words(text);
    let lines: Vec<usize> = found.iter().map(|(line, _)| *line).collect();
    assert_eq!(lines, [1, 1, 2, 3, 3, 4], "{found:?}");
    assert_eq!(found[0].1, "\"was lent\"");
    assert_eq!(found[1].1, "\"this work\"");
    assert_eq!(found[3].1, "an issue's number (`issue 72`)");
    assert_eq!(found[4].1, "an issue's number (`#45`)");
    assert_eq!(found[5].1, "TODO");
}

/// Every fenced block of the documents, as (document, block).
fn blocks() -> Vec<(PathBuf, Block)> {
    documents()
        .into_iter()
        .flat_map(|(path, text)| split(&text).blocks.into_iter().map(move |b| (path.clone(), b)))
        .collect()
}

/// `README.md:83 (```rust,no_run)`: where a block is, for messages.
fn at(path: &Path, block: &Block) -> String {
    format!("{}:{} (```{})", path.display(), block.line, block.info)
}

/// The blocks marked as `language`.
fn blocks_of(language: Language) -> Vec<(PathBuf, Block)> {
    blocks().into_iter().filter(|(_, block)| Language::of(&block.info).as_ref() == Some(&language)).collect()
}

/// A file of the user-crate template (`crates/build-support/template/`) as the documents show
/// it: the checkout's path as `/path/to/stageload`.
fn template(file: &str) -> String {
    let path = checkout().join("crates/build-support/template").join(file);
    fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .replace("@CHECKOUT@", "/path/to/stageload")
}

#[test]
fn every_code_block_is_marked_with_a_language_that_is_checked() {
    let all = blocks();
    assert!(all.len() > 10, "only {} fenced blocks found: the block reader is broken", all.len());
    let unmarked: Vec<String> = all
        .iter()
        .filter(|(_, block)| Language::of(&block.info).is_none())
        .map(|(path, block)| at(path, block))
        .collect();
    assert!(
        unmarked.is_empty(),
        "blocks with no language, or one nothing checks (mark them rust, sh, toml, python or text):\n{}",
        unmarked.join("\n")
    );
}

#[test]
fn rustdoc_compiles_every_document_as_doc_tests() {
    let lib = fs::read_to_string(checkout().join("crates/torch/src/lib.rs")).unwrap();
    let guide = lib.split("#[cfg(doctest)]").nth(1).expect("crates/torch/src/lib.rs has no #[cfg(doctest)] module");
    let missing: Vec<String> = documents()
        .into_iter()
        .map(|(path, _)| format!("include_str!(\"../../../{}\")", path.display()))
        .filter(|include| !guide.contains(include.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "documents whose Rust blocks rustdoc does not compile: add to the `guide` module of \
         crates/torch/src/lib.rs:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_rust_block_is_compiled_none_ignored_but_the_build_script() {
    let build_script = template("build.rs");
    let (mut compiled, mut build_scripts, mut wrong) = (0, 0, Vec::new());
    for (path, block) in blocks_of(Language::Rust) {
        let attributes: Vec<&str> = block.info.split(',').skip(1).map(str::trim).collect();
        let known = |a: &&str| matches!(*a, "no_run" | "should_panic" | "ignore") || a.starts_with("edition");
        if let Some(unknown) = attributes.iter().find(|a| !known(a)) {
            wrong.push(format!("{}: `{unknown}`: rustdoc would not compile it as written", at(&path, &block)));
        } else if attributes.contains(&"ignore") {
            if block.text == build_script {
                build_scripts += 1;
            } else {
                wrong.push(format!(
                    "{}: ignored; give it hidden set-up lines (`# `) so that it compiles",
                    at(&path, &block)
                ));
            }
        } else {
            compiled += 1;
        }
    }
    assert!(wrong.is_empty(), "Rust blocks not compiled:\n{}", wrong.join("\n"));
    assert!(
        compiled >= 5 && build_scripts >= 1,
        "{compiled} compiled, {build_scripts} build scripts: the reader is broken"
    );
}

/// Writes a safetensors file of `names`, each an f32 tensor of 4 zeros.
fn write_checkpoint(path: &Path, names: &[String]) {
    let mut header = serde_json::Map::new();
    for (i, name) in names.iter().enumerate() {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * (i + 1)]}),
        );
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.resize(bytes.len() + 16 * names.len(), 0);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, bytes).unwrap();
}

/// A pipeline description read by `stageload plan`'s reader, in a folder where every checkpoint
/// it names exists (a streamed model's with a tensor for each resident name and two blocks).
fn read_pipeline(text: &str) -> Result<stageload_plan::Pipeline, String> {
    let folder = tempfile::TempDir::new().unwrap();
    let file: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    let strings = |value: Option<&toml::Value>| -> Vec<String> {
        let list = value.and_then(toml::Value::as_array).map(Vec::as_slice).unwrap_or_default();
        list.iter().filter_map(|v| v.as_str().map(String::from)).collect()
    };
    let models = file.get("models").and_then(toml::Value::as_array).map(Vec::as_slice).unwrap_or_default();
    for model in models {
        let names = match model.get("stream") {
            Some(stream) => {
                let resident = strings(stream.get("resident")).into_iter().map(|r| format!("{r}.weight"));
                let blocks = strings(stream.get("blocks"))
                    .into_iter()
                    .flat_map(|b| ["0", "1"].map(|i| format!("{}.weight", b.replace('*', i))));
                resident.chain(blocks).collect()
            }
            None => vec!["weight".to_string()],
        };
        for file in strings(model.get("files")) {
            write_checkpoint(&folder.path().join(file), &names);
        }
    }
    stageload_plan::Pipeline::parse(text, &folder.path().join("pipeline.toml")).map_err(|e| e.to_string())
}

#[test]
fn every_toml_block_is_read_as_what_it_shows() {
    let manifest = template("Cargo.toml.in");
    let dependencies: Vec<&str> = manifest.split("\n\n").filter(|part| part.contains("dependencies]")).collect();
    let dependencies = dependencies.join("\n\n");
    let (mut pipelines, mut manifests, mut wrong) = (0, 0, Vec::new());
    for (path, block) in blocks_of(Language::Toml) {
        if block.text.contains("[[stages]]") {
            match read_pipeline(&block.text) {
                Ok(_) => pipelines += 1,
                Err(e) => {
                    wrong.push(format!("{}: not a pipeline description `stageload plan` reads: {e}", at(&path, &block)))
                }
            }
        } else if block.text.trim_end() == dependencies.trim_end() {
            manifests += 1;
        } else {
            wrong.push(format!(
                "{}: neither a pipeline description nor the dependency lines of \
                 crates/build-support/template/Cargo.toml.in (which its test builds):\n{dependencies}",
                at(&path, &block)
            ));
        }
    }
    assert!(wrong.is_empty(), "TOML blocks not read as shown:\n{}", wrong.join("\n"));
    assert!(pipelines >= 1 && manifests >= 1, "{pipelines} pipelines, {manifests} manifests: the reader is broken");
}

#[test]
fn the_pipeline_reader_of_this_check_refuses_what_stageload_plan_refuses() {
    let good = "[[models]]\nname = \"a\"\nfiles = [\"a.safetensors\"]\n\n[[stages]]\nname = \"s\"\nmodels = [\"a\"]\n";
    read_pipeline(good).unwrap();
    let unknown_key = good.replace("files =", "file =");
    assert!(read_pipeline(&unknown_key).is_err(), "a key the file format does not have was read");
    let unknown_model = good.replace("models = [\"a\"]", "models = [\"b\"]");
    assert!(read_pipeline(&unknown_model).is_err(), "a stage naming an unknown model was read");
}

#[test]
fn every_python_block_compiles() {
    let python = std::env::var("STAGELOAD_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let blocks = blocks_of(Language::Python);
    assert!(!blocks.is_empty(), "no Python block found: the block reader is broken");
    for (path, block) in blocks {
        let name = at(&path, &block);
        let mut child = std::process::Command::new(&python)
            .args(["-c", "import sys; compile(sys.stdin.read(), sys.argv[1], 'exec')", &name])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{python}: {e} (set STAGELOAD_PYTHON to a Python 3)"));
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), block.text.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{name} does not compile:\n{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn code_links_and_commands_are_told_apart() {
    let text = "See [the guide](docs/README.md#top) and [the web](https://example.com), `stageload plan\n\
                pipeline.toml` and ``a `[x](no.md)` b``.\n\n```sh\nstageload guard -- [y](nor.md)\ncargo xtask \
                demo -- --scale 0.1\n```\n\n[ref]: traces/\nstageload is not a command here.\n\n```\nas stageload \
                prints them\n```\n";
    let parts = split(text);
    assert_eq!(link_targets(&parts.prose), ["docs/README.md#top", "https://example.com", "traces/"]);
    let commands: Vec<String> = parts.code.iter().flat_map(|code| named_after(code, "stageload", None)).collect();
    assert_eq!(commands, ["plan", "guard"]);
    let tasks: Vec<String> = parts.code.iter().flat_map(|code| named_after(code, "cargo", Some("xtask"))).collect();
    assert_eq!(tasks, ["demo"]);
    assert_eq!(named_after("cargo xtask --help", "cargo", Some("xtask")), Vec::<String>::new());
    assert_eq!(relative_path("docs/README.md#top"), Some("docs/README.md"));
    assert_eq!(relative_path("#top"), None);
    assert_eq!(resolve(Path::new("docs"), "../traces/gpu/"), Some(PathBuf::from("traces/gpu")));
    assert_eq!(resolve(Path::new(""), "../elsewhere.md"), None);
}

#[test]
fn clap_variants_are_read_in_kebab_case_or_as_renamed() {
    let source = "enum Task {\n    /// Runs { braces } in a doc\n    Test { fast: bool },\n    HotSetBench {\n        \
                  out: PathBuf,\n    },\n    #[command(name = \"gpu\", alias = \"g\")]\n    GpuCheck(Args),\n    Ab,\n}\n\
                  enum Other {\n    Build,\n}\n";
    let names = enum_subcommands(source, "Task").unwrap();
    assert_eq!(names, ["ab", "g", "gpu", "hot-set-bench", "test"].map(String::from).into_iter().collect());
}

#[test]
fn fenced_blocks_are_read_with_their_language_line_and_text() {
    let text = "# Title\n\n```rust,no_run\nlet x = 1;\n```\n\n````\ntree\n```\n````\n\n~~~python\nprint(1)\n~~~\n";
    let blocks = split(text).blocks;
    let read: Vec<(&str, usize, &str)> = blocks.iter().map(|b| (b.info.as_str(), b.line, b.text.as_str())).collect();
    assert_eq!(read, [("rust,no_run", 3, "let x = 1;\n"), ("", 7, "tree\n```\n"), ("python", 12, "print(1)\n")]);
    assert_eq!(Language::of("rust,no_run"), Some(Language::Rust));
    assert_eq!(Language::of("rust"), Some(Language::Rust));
    assert_eq!(Language::of("sh"), Some(Language::Shell));
    assert_eq!(Language::of("toml"), Some(Language::Toml));
    assert_eq!(Language::of("text"), Some(Language::Text));
    assert_eq!(Language::of(""), None, "a block with no language is compiled by rustdoc as Rust");
    assert_eq!(Language::of("rs"), None);
}
