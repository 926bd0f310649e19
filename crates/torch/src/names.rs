//! How a checkpoint's entry names meet a model's tensor names: a rename rule (a prefix the
//! file's names carry or lack, or a closure), entries to ignore (glob patterns on the file's
//! names), and strictness. Pure string work, no libtorch: `match_names` pairs entries with
//! tensors and [`NameMismatch`] explains a mismatch with the names on both sides and the prefix
//! that would explain it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

/// Maps a file entry's name to the model tensor it fills (`None`: no tensor).
pub type RenameFn = dyn Fn(&str) -> Option<String> + Send + Sync;

/// How file entry names become model tensor names.
#[derive(Clone, Default)]
pub enum Rename {
    /// The same names.
    #[default]
    Same,
    /// The file's names carry this prefix; the model's do not (`bert.encoder.…` → `encoder.…`).
    /// Entries without it keep their name.
    StripPrefix(String),
    /// The model's names carry this prefix; the file's do not.
    AddPrefix(String),
    /// Any mapping.
    With(Arc<RenameFn>),
}

impl fmt::Debug for Rename {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rename::Same => write!(f, "Same"),
            Rename::StripPrefix(p) => write!(f, "StripPrefix({p:?})"),
            Rename::AddPrefix(p) => write!(f, "AddPrefix({p:?})"),
            Rename::With(_) => write!(f, "With(<closure>)"),
        }
    }
}

impl Rename {
    /// The model tensor name for file entry `entry`.
    pub fn apply(&self, entry: &str) -> Option<String> {
        match self {
            Rename::Same => Some(entry.to_string()),
            Rename::StripPrefix(prefix) => Some(entry.strip_prefix(prefix.as_str()).unwrap_or(entry).to_string()),
            Rename::AddPrefix(prefix) => Some(format!("{prefix}{entry}")),
            Rename::With(f) => f(entry),
        }
    }
}

/// A model's rules for its checkpoint's names. Default: same names, nothing ignored, strict.
/// Given to a model with [`ModelSpec::names`](crate::ModelSpec::names).
///
/// ```
/// use stageload::NameRules;
///
/// // The file says `encoder.layer.0.weight`, the model `bert.encoder.layer.0.weight`; the
/// // file's pooler is not part of the model.
/// let rules = NameRules::default().add_prefix("bert.").ignore(["pooler.*"])?;
/// assert_eq!(rules.rename.apply("encoder.layer.0.weight").as_deref(), Some("bert.encoder.layer.0.weight"));
/// # Ok::<(), stageload::names::PatternError>(())
/// ```
#[derive(Debug, Clone)]
pub struct NameRules {
    /// How file entry names become model tensor names.
    pub rename: Rename,
    ignore: Vec<glob::Pattern>,
    /// Model tensors filled already (a shared component another model loaded, a storage
    /// another model keeps or another refill fills): the entries naming them, after renaming,
    /// are skipped and counted as ignored.
    filled_elsewhere: HashSet<String>,
    /// Strict: any file entry that fills no tensor (and is not ignored), or any model tensor no
    /// entry fills, is an error. Lenient: loads what matches and reports the rest.
    pub strict: bool,
    /// Every model tensor must be filled, whatever `strict` says (a refill in place: a tensor
    /// left unfilled would hold whatever its new memory held).
    pub(crate) complete: bool,
}

impl Default for NameRules {
    fn default() -> Self {
        NameRules {
            rename: Rename::Same,
            ignore: Vec::new(),
            filled_elsewhere: HashSet::new(),
            strict: true,
            complete: false,
        }
    }
}

/// A bad `ignore` pattern.
#[derive(Debug, thiserror::Error)]
#[error("ignore pattern '{pattern}' is not a valid glob: {reason}")]
pub struct PatternError {
    /// The pattern as given.
    pub pattern: String,
    /// Why `glob` refuses it.
    pub reason: String,
}

impl NameRules {
    /// The file's names carry `prefix` (e.g. `"bert."`); the model's do not.
    pub fn strip_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.rename = Rename::StripPrefix(prefix.into());
        self
    }

    /// The model's names carry `prefix`; the file's do not.
    pub fn add_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.rename = Rename::AddPrefix(prefix.into());
        self
    }

    /// Any mapping from a file entry's name to the model tensor it fills.
    pub fn rename_with(mut self, f: impl Fn(&str) -> Option<String> + Send + Sync + 'static) -> Self {
        self.rename = Rename::With(Arc::new(f));
        self
    }

    /// File entries to skip, as globs over the file's names (`pooler.*`,
    /// `embeddings.position_ids`).
    pub fn ignore<S: AsRef<str>>(mut self, patterns: impl IntoIterator<Item = S>) -> Result<Self, PatternError> {
        for pattern in patterns {
            let pattern = pattern.as_ref();
            let compiled = glob::Pattern::new(pattern)
                .map_err(|e| PatternError { pattern: pattern.to_string(), reason: e.msg.to_string() })?;
            self.ignore.push(compiled);
        }
        Ok(self)
    }

    /// Strict (default) or lenient, see [`NameRules::strict`].
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// These model tensors were filled elsewhere: skip the entries that name them.
    pub(crate) fn filled_elsewhere(mut self, tensors: impl IntoIterator<Item = String>) -> Self {
        self.filled_elsewhere.extend(tensors);
        self
    }

    /// Every model tensor must be filled, whatever the strictness: a refill in place.
    pub(crate) fn complete(mut self) -> Self {
        self.complete = true;
        self
    }

    /// Whether `entry` is skipped: an `ignore` pattern matches it, or it names a tensor filled
    /// elsewhere (`renamed`: the tensor it names).
    fn ignores(&self, entry: &str, renamed: Option<&str>) -> bool {
        renamed.is_some_and(|tensor| self.filled_elsewhere.contains(tensor))
            || self.ignore.iter().any(|p| p.matches(entry))
    }
}

/// Which entry fills which tensor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct NameMatch {
    /// Model tensor name → file entry name.
    pub pairs: BTreeMap<String, String>,
    /// File entries nothing asked for and no pattern ignores, sorted.
    pub unused: Vec<String>,
    /// File entries an ignore pattern (or another model's fill) skipped.
    pub ignored: usize,
    /// Model tensors no entry fills, in the model's order.
    pub missing: Vec<String>,
    /// Model tensors that need no entry: alias → the tensor whose entry fills their storage
    /// (tied weights). Found by the checkpoint, which sees storages; none from `match_names`.
    pub aliases: BTreeMap<String, String>,
}

/// Two file entries that the rename maps onto one model tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("file entries '{first}' and '{second}' both map to the model's tensor '{tensor}'; change the rename rule or ignore one of them")]
pub struct Collision {
    /// The model tensor both map onto.
    pub tensor: String,
    /// The first entry, in name order.
    pub first: String,
    /// The second entry.
    pub second: String,
}

/// Pairs `entries` (the files' names) with `tensors` (the model's) under `rules`.
pub(crate) fn match_names<'a>(
    entries: impl IntoIterator<Item = &'a str>,
    tensors: &[&str],
    rules: &NameRules,
) -> Result<NameMatch, Collision> {
    let wanted: HashSet<&str> = tensors.iter().copied().collect();
    let mut found = NameMatch::default();
    let mut claimed: HashMap<String, String> = HashMap::new();
    let mut entries: Vec<&str> = entries.into_iter().collect();
    entries.sort_unstable();
    for entry in entries {
        let renamed = rules.rename.apply(entry);
        if rules.ignores(entry, renamed.as_deref()) {
            found.ignored += 1;
            continue;
        }
        match renamed.filter(|name| wanted.contains(name.as_str())) {
            Some(tensor) => {
                if let Some(first) = claimed.insert(tensor.clone(), entry.to_string()) {
                    return Err(Collision { tensor, first, second: entry.to_string() });
                }
            }
            None => found.unused.push(entry.to_string()),
        }
    }
    found.missing = tensors.iter().filter(|t| !claimed.contains_key(**t)).map(|t| t.to_string()).collect();
    found.pairs = claimed.into_iter().collect();
    Ok(found)
}

/// A strict load whose names did not match: the model's tensors without an entry, the entries
/// without a tensor, a few of each side by side, and the prefix rule that would explain it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameMismatch {
    /// Model tensors no entry fills, in the model's order.
    pub missing: Vec<String>,
    /// File entries that fill no tensor and no pattern ignores, sorted.
    pub unused: Vec<String>,
    /// `(model tensor, nearest file entry)` for a few missing tensors.
    pub nearest: Vec<(String, String)>,
    /// A rule that pairs most of them, e.g. `NameRules::default().strip_prefix("bert.")`.
    pub suggestion: Option<String>,
}

const SHOWN: usize = 3;

impl NameMismatch {
    /// The mismatch of a match that left tensors missing or entries unused.
    pub(crate) fn new(found: &NameMatch) -> Self {
        let nearest = found
            .missing
            .iter()
            .take(SHOWN)
            .filter_map(|m| nearest(m, &found.unused).map(|f| (m.clone(), f.to_string())))
            .collect();
        NameMismatch {
            missing: found.missing.clone(),
            unused: found.unused.clone(),
            nearest,
            suggestion: suggest_prefix(&found.missing, &found.unused),
        }
    }
}

impl fmt::Display for NameMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let few = |names: &[String]| {
            let shown: Vec<String> = names.iter().take(SHOWN).map(|n| format!("'{n}'")).collect();
            let more = names.len().saturating_sub(SHOWN);
            if more > 0 {
                format!("{} and {more} more", shown.join(", "))
            } else {
                shown.join(", ")
            }
        };
        write!(f, "names do not match: ")?;
        let mut parts = Vec::new();
        if !self.missing.is_empty() {
            parts.push(format!("{} model tensor(s) have no entry ({})", self.missing.len(), few(&self.missing)));
        }
        if !self.unused.is_empty() {
            parts.push(format!("{} file entries fill no tensor ({})", self.unused.len(), few(&self.unused)));
        }
        write!(f, "{}", parts.join("; "))?;
        for (model, file) in &self.nearest {
            write!(f, "; model '{model}' ~ file '{file}'")?;
        }
        match &self.suggestion {
            Some(rule) => write!(f, ". Try ModelSpec::names({rule})"),
            None => write!(
                f,
                ". Map the names with ModelSpec::names(NameRules::default().strip_prefix(..) / add_prefix(..) / rename_with(..)), ignore entries with .ignore([..]), or load leniently with .strict(false)"
            ),
        }
    }
}

impl std::error::Error for NameMismatch {}

/// The unused entry sharing the longest dotted suffix with `tensor`.
fn nearest<'a>(tensor: &str, unused: &'a [String]) -> Option<&'a str> {
    let parts: Vec<&str> = tensor.rsplit('.').collect();
    unused
        .iter()
        .map(|u| (u.rsplit('.').zip(&parts).take_while(|(a, b)| a == *b).count(), u))
        .filter(|(common, _)| *common > 0)
        .max_by_key(|(common, u)| (*common, std::cmp::Reverse(u.len())))
        .map(|(_, u)| u.as_str())
}

/// A prefix rule that pairs at least half of the missing tensors with unused entries.
fn suggest_prefix(missing: &[String], unused: &[String]) -> Option<String> {
    let unused_set: HashSet<&str> = unused.iter().map(String::as_str).collect();
    let missing_set: HashSet<&str> = missing.iter().map(String::as_str).collect();
    let enough = |paired: usize| paired > 0 && paired * 2 >= missing.len();
    for m in missing.iter().take(SHOWN) {
        // The file's names carry a prefix: entry = prefix + tensor.
        for u in unused.iter().filter(|u| u.len() > m.len() && u.ends_with(m.as_str())) {
            let prefix = &u[..u.len() - m.len()];
            if enough(missing.iter().filter(|t| unused_set.contains(format!("{prefix}{t}").as_str())).count()) {
                return Some(format!("NameRules::default().strip_prefix({prefix:?})"));
            }
        }
        // The model's names carry a prefix: tensor = prefix + entry.
        for u in unused.iter().filter(|u| m.len() > u.len() && m.ends_with(u.as_str())) {
            let prefix = &m[..m.len() - u.len()];
            let paired = unused.iter().filter(|e| missing_set.contains(format!("{prefix}{e}").as_str())).count();
            if enough(paired) {
                return Some(format!("NameRules::default().add_prefix({prefix:?})"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: [&str; 3] = ["embeddings.word.weight", "encoder.layer.0.weight", "encoder.layer.0.bias"];

    #[test]
    fn same_names_pair_and_extra_entries_are_reported_unused() {
        let found = match_names(
            ["encoder.layer.0.bias", "embeddings.word.weight", "encoder.layer.0.weight", "pooler.weight"],
            &MODEL,
            &NameRules::default(),
        )
        .unwrap();
        assert_eq!(found.pairs.len(), 3);
        assert_eq!(found.unused, ["pooler.weight"]);
        assert!(found.missing.is_empty());
    }

    #[test]
    fn ignore_patterns_skip_entries_and_count_them() {
        let rules = NameRules::default().ignore(["pooler.*", "embeddings.position_ids"]).unwrap();
        let found = match_names(
            ["pooler.weight", "pooler.bias", "embeddings.position_ids", "embeddings.word.weight"],
            &MODEL,
            &rules,
        )
        .unwrap();
        assert_eq!((found.ignored, found.unused.len()), (3, 0));
        assert_eq!(found.missing, ["encoder.layer.0.weight", "encoder.layer.0.bias"]);
    }

    #[test]
    fn a_prefix_the_file_carries_is_stripped_and_one_it_lacks_is_added() {
        let file = ["bert.embeddings.word.weight", "bert.encoder.layer.0.weight", "bert.encoder.layer.0.bias"];
        let found = match_names(file, &MODEL, &NameRules::default().strip_prefix("bert.")).unwrap();
        assert!(found.missing.is_empty() && found.unused.is_empty());
        let model = ["model.a", "model.b"];
        let found = match_names(["a", "b"], &model, &NameRules::default().add_prefix("model.")).unwrap();
        assert_eq!(found.pairs["model.a"], "a");
    }

    #[test]
    fn two_entries_renamed_onto_one_tensor_are_refused_by_name() {
        let rules = NameRules::default().rename_with(|_| Some("encoder.layer.0.bias".into()));
        let err = match_names(["x", "y"], &MODEL, &rules).unwrap_err();
        assert_eq!((err.tensor.as_str(), err.first.as_str(), err.second.as_str()), ("encoder.layer.0.bias", "x", "y"));
    }

    #[test]
    fn a_mismatch_shows_both_sides_and_suggests_the_prefix_that_explains_it() {
        let file = ["bert.embeddings.word.weight", "bert.encoder.layer.0.weight", "bert.encoder.layer.0.bias"];
        let mismatch = NameMismatch::new(&match_names(file, &MODEL, &NameRules::default()).unwrap());
        assert_eq!(mismatch.suggestion.as_deref(), Some("NameRules::default().strip_prefix(\"bert.\")"));
        assert_eq!(
            mismatch.nearest[0],
            ("embeddings.word.weight".to_string(), "bert.embeddings.word.weight".to_string())
        );
        let text = mismatch.to_string();
        assert!(text.contains("3 model tensor(s) have no entry") && text.contains("strip_prefix(\"bert.\")"), "{text}");
        assert!(text.len() < 800, "one readable line, not a dump: {} chars", text.len());

        let model = ["model.a.weight", "model.b.weight"];
        let mismatch =
            NameMismatch::new(&match_names(["a.weight", "b.weight"], &model, &NameRules::default()).unwrap());
        assert_eq!(mismatch.suggestion.as_deref(), Some("NameRules::default().add_prefix(\"model.\")"));
    }

    #[test]
    fn a_prefix_that_matches_nothing_leaves_everything_missing_and_suggests_none() {
        let found = match_names(["x.y", "z.w"], &MODEL, &NameRules::default().strip_prefix("nothing.")).unwrap();
        assert_eq!(found.missing.len(), 3);
        let mismatch = NameMismatch::new(&found);
        assert_eq!(mismatch.suggestion, None);
        assert!(mismatch.to_string().contains("strict(false)"));
    }

    #[test]
    fn a_bad_glob_is_an_error_naming_it() {
        let err = NameRules::default().ignore(["pooler.[*"]).unwrap_err();
        assert!(err.to_string().contains("pooler.[*"), "{err}");
    }
}
