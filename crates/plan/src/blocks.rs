//! Which of a model's tensors make up each block: pure name work, no libtorch.
//!
//! A [`BlockSpec`] lists the blocks in the order the forward runs them, each as a tensor-name
//! prefix (`encoder.layer.3`: that name and every name under it) or a pattern ending in `.*`
//! that stands for one block per child (`model.blocks.*`: `model.blocks.0`, `model.blocks.1`, …,
//! in numeric order when every child is a number, else in the order the names come). Tensors in
//! no block must be named as resident (embeddings, final norms): a tensor left out, or one two
//! entries claim, is refused with its name.

use std::collections::HashMap;

/// How a model's tensors fall into blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockSpec {
    blocks: Vec<String>,
    resident: Vec<String>,
}

impl BlockSpec {
    /// Blocks in the order the forward runs them: prefixes, or patterns ending in `.*`.
    pub fn new<S: Into<String>>(blocks: impl IntoIterator<Item = S>) -> Self {
        BlockSpec { blocks: blocks.into_iter().map(Into::into).collect(), resident: Vec::new() }
    }

    /// The block entries, as given.
    pub fn blocks(&self) -> &[String] {
        &self.blocks
    }

    /// The resident prefixes, as given.
    pub fn resident_prefixes(&self) -> &[String] {
        &self.resident
    }

    /// Prefixes of the tensors in no block; they stay resident.
    pub fn resident<S: Into<String>>(mut self, prefixes: impl IntoIterator<Item = S>) -> Self {
        self.resident = prefixes.into_iter().map(Into::into).collect();
        self
    }
}

/// Tensors by block: indexes into the name list [`assign`] was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Each block's name and tensors, in run order.
    pub blocks: Vec<(String, Vec<usize>)>,
    /// Tensors in no block.
    pub fixed: Vec<usize>,
}

/// A block list that does not cover the model's tensors exactly once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockError {
    /// No block pattern was given.
    #[error("the block list is empty: name the model's blocks (e.g. \"model.blocks.*\")")]
    NoBlocks,
    /// A pattern has a `*` before its last segment.
    #[error("block pattern '{pattern}' has a '*' that is not its last segment: write it as 'prefix.*'")]
    Pattern {
        /// The pattern as given.
        pattern: String,
    },
    /// A block names no tensor of the model.
    #[error("block '{entry}' matches none of the model's tensors (they begin {sample})")]
    Unmatched {
        /// The block as given.
        entry: String,
        /// The first few tensor names, to compare with.
        sample: String,
    },
    /// A tensor falls in two blocks (or a block and the resident list).
    #[error("tensor '{tensor}' is in both '{first}' and '{second}': each tensor belongs to one block (or to the resident list)")]
    Twice {
        /// The tensor.
        tensor: String,
        /// The first block (or list) it falls in.
        first: String,
        /// The second.
        second: String,
    },
    /// Tensors that are in no block and not resident.
    #[error(
        "{} tensor(s) are in no block and not resident: {}; add them to a block or to the resident list",
        tensors.len(), list(tensors)
    )]
    Unassigned {
        /// Their names.
        tensors: Vec<String>,
    },
}

fn list(names: &[String]) -> String {
    const SHOWN: usize = 6;
    let mut text = names.iter().take(SHOWN).map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        text += &format!(" and {} more", names.len() - SHOWN);
    }
    text
}

/// Whether `name` is `prefix` or lies under it.
fn under(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// Places every name of `names` in one block or in the fixed set.
pub fn assign(spec: &BlockSpec, names: &[&str]) -> Result<Layout, BlockError> {
    if spec.blocks.is_empty() {
        return Err(BlockError::NoBlocks);
    }
    // Owner of each tensor: (entry label, block index or None for resident).
    let mut owner: Vec<Option<(String, Option<usize>)>> = vec![None; names.len()];
    let mut blocks: Vec<(String, Vec<usize>)> = Vec::new();
    let claim = |tensor: usize, label: &str, block: Option<usize>, owner: &mut Vec<Option<(String, Option<usize>)>>| {
        if let Some((first, _)) = &owner[tensor] {
            return Err(BlockError::Twice {
                tensor: names[tensor].to_string(),
                first: first.clone(),
                second: label.to_string(),
            });
        }
        owner[tensor] = Some((label.to_string(), block));
        Ok(())
    };
    for entry in &spec.blocks {
        let expanded = expand(entry, names)?;
        if expanded.is_empty() {
            return Err(unmatched(entry, names));
        }
        for (block_name, tensors) in expanded {
            let index = blocks.len();
            for &tensor in &tensors {
                claim(tensor, &block_name, Some(index), &mut owner)?;
            }
            blocks.push((block_name, tensors));
        }
    }
    let mut fixed = Vec::new();
    for prefix in &spec.resident {
        let matched: Vec<usize> = (0..names.len()).filter(|&i| under(names[i], prefix)).collect();
        if matched.is_empty() {
            return Err(unmatched(prefix, names));
        }
        for tensor in matched {
            claim(tensor, prefix, None, &mut owner)?;
            fixed.push(tensor);
        }
    }
    let unassigned: Vec<String> =
        owner.iter().zip(names).filter(|(o, _)| o.is_none()).map(|(_, n)| n.to_string()).collect();
    if !unassigned.is_empty() {
        return Err(BlockError::Unassigned { tensors: unassigned });
    }
    fixed.sort_unstable();
    Ok(Layout { blocks, fixed })
}

fn unmatched(entry: &str, names: &[&str]) -> BlockError {
    let mut sample: Vec<&str> = names.iter().take(3).copied().collect();
    sample.sort_unstable();
    BlockError::Unmatched {
        entry: entry.to_string(),
        sample: sample.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", "),
    }
}

/// One entry of a spec as blocks: a prefix is one block; `prefix.*` one block per child.
fn expand(entry: &str, names: &[&str]) -> Result<Vec<(String, Vec<usize>)>, BlockError> {
    let Some(parent) = entry.strip_suffix(".*") else {
        if entry.contains('*') {
            return Err(BlockError::Pattern { pattern: entry.to_string() });
        }
        let tensors: Vec<usize> = (0..names.len()).filter(|&i| under(names[i], entry)).collect();
        return Ok(if tensors.is_empty() { Vec::new() } else { vec![(entry.to_string(), tensors)] });
    };
    if parent.contains('*') {
        return Err(BlockError::Pattern { pattern: entry.to_string() });
    }
    let mut children: Vec<(String, Vec<usize>)> = Vec::new();
    let mut position: HashMap<String, usize> = HashMap::new();
    for (i, name) in names.iter().enumerate() {
        let Some(rest) = name.strip_prefix(parent).and_then(|r| r.strip_prefix('.')) else { continue };
        let child = rest.split('.').next().unwrap_or(rest);
        let at = *position.entry(child.to_string()).or_insert_with(|| {
            children.push((format!("{parent}.{child}"), Vec::new()));
            children.len() - 1
        });
        children[at].1.push(i);
    }
    let numbers: Option<Vec<u64>> =
        children.iter().map(|(name, _)| name[parent.len() + 1..].parse::<u64>().ok()).collect();
    if let Some(numbers) = numbers {
        let mut keyed: Vec<_> = numbers.into_iter().zip(children).collect();
        keyed.sort_by_key(|(n, _)| *n);
        children = keyed.into_iter().map(|(_, c)| c).collect();
    }
    Ok(children)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: [&str; 9] = [
        "model.input.weight",
        "model.blocks.10.fc.weight",
        "model.blocks.2.fc.weight",
        "model.blocks.2.fc.bias",
        "model.blocks.0.fc.weight",
        "model.norm.weight",
        "model.norm.bias",
        "model.output.weight",
        "model.blocks.1.fc.weight",
    ];

    fn names_of(layout: &Layout) -> Vec<(String, Vec<&'static str>)> {
        layout.blocks.iter().map(|(b, t)| (b.clone(), t.iter().map(|&i| NAMES[i]).collect())).collect()
    }

    fn spec() -> BlockSpec {
        BlockSpec::new(["model.blocks.*"]).resident(["model.input", "model.norm", "model.output"])
    }

    #[test]
    fn a_pattern_makes_one_block_per_child_in_numeric_order() {
        let layout = assign(&spec(), &NAMES).unwrap();
        let blocks = names_of(&layout);
        let order: Vec<&str> = blocks.iter().map(|(b, _)| b.as_str()).collect();
        assert_eq!(order, ["model.blocks.0", "model.blocks.1", "model.blocks.2", "model.blocks.10"]);
        assert_eq!(blocks[2].1, ["model.blocks.2.fc.weight", "model.blocks.2.fc.bias"]);
        assert_eq!(layout.fixed, [0, 5, 6, 7]);
    }

    #[test]
    fn prefixes_are_blocks_in_the_order_given_and_match_whole_segments() {
        let names = ["enc.layer1.w", "enc.layer10.w", "enc.layer1", "head.w"];
        let layout = assign(&BlockSpec::new(["enc.layer10", "enc.layer1"]).resident(["head"]), &names).unwrap();
        assert_eq!(layout.blocks, [("enc.layer10".to_string(), vec![1]), ("enc.layer1".to_string(), vec![0, 2])]);
    }

    #[test]
    fn a_tensor_in_no_block_is_refused_with_its_name() {
        let err = assign(&BlockSpec::new(["model.blocks.*"]).resident(["model.input"]), &NAMES).unwrap_err();
        assert_eq!(
            err,
            BlockError::Unassigned {
                tensors: vec!["model.norm.weight".into(), "model.norm.bias".into(), "model.output.weight".into()]
            }
        );
        assert!(err.to_string().contains("'model.norm.weight'"), "{err}");
    }

    #[test]
    fn a_tensor_named_twice_is_refused_naming_both_claims() {
        let spec = BlockSpec::new(["model.blocks.*", "model.blocks.2"]).resident([
            "model.input",
            "model.norm",
            "model.output",
        ]);
        let err = assign(&spec, &NAMES).unwrap_err();
        assert_eq!(
            err,
            BlockError::Twice {
                tensor: "model.blocks.2.fc.weight".into(),
                first: "model.blocks.2".into(),
                second: "model.blocks.2".into()
            }
        );
        let spec = spec_with_resident_overlap();
        assert!(matches!(assign(&spec, &NAMES), Err(BlockError::Twice { .. })));
    }

    fn spec_with_resident_overlap() -> BlockSpec {
        BlockSpec::new(["model.blocks.*"]).resident(["model", "model.input"])
    }

    #[test]
    fn an_entry_matching_nothing_and_a_misplaced_star_are_refused() {
        assert!(matches!(assign(&BlockSpec::new(["model.layers.*"]), &NAMES), Err(BlockError::Unmatched { .. })));
        assert!(matches!(assign(&BlockSpec::new(["model.*.fc"]), &NAMES), Err(BlockError::Pattern { .. })));
        assert!(matches!(assign(&BlockSpec::new(Vec::<String>::new()), &NAMES), Err(BlockError::NoBlocks)));
        let err = assign(&spec().resident(["model.missing"]), &NAMES).unwrap_err();
        assert!(err.to_string().contains("'model.missing'"), "{err}");
    }

    #[test]
    fn children_that_are_not_numbers_keep_the_order_of_the_names() {
        let names = ["b.up.w", "b.down.w", "b.mid.w"];
        let layout = assign(&BlockSpec::new(["b.*"]), &names).unwrap();
        let order: Vec<&str> = layout.blocks.iter().map(|(b, _)| b.as_str()).collect();
        assert_eq!(order, ["b.up", "b.down", "b.mid"]);
    }
}
