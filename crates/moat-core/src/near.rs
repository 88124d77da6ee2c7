//! "Did you mean": which of some names a typed word is most likely a typo of,
//! so that a mistyped box or command is told as one (and never taken for
//! something else, as `ssh b11@HOST ls` once listed boxes when `b1` was meant).

/// Most edits (insertions, deletions, substitutions) a typo is taken to have.
pub const MAX_EDITS: usize = 2;

/// Shortest prefix that makes a typo of any longer word.
const MIN_PREFIX: usize = 3;

/// Longest word compared: names are DNS labels, and a longer word is nobody's
/// typo (it also bounds the work a client's word can cost).
const MAX_LEN: usize = 64;

/// The candidate `typed` is most likely a typo of: one within [`MAX_EDITS`]
/// edits (one for a word of four letters or fewer) that change at most half
/// the letters of the longer (two edits make any two-letter word of any
/// other), or one of which `typed` is a prefix or that is a prefix of `typed`,
/// the prefix three letters or more (`ssh HOST ls` by a local user `root` is
/// no typo of a box `r`). The fewest edits wins, then the first listed.
/// A candidate equal to `typed` is no typo of it.
pub fn closest<'a>(typed: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    if typed.is_empty() || typed.len() > MAX_LEN {
        return None;
    }
    let mut best: Option<(usize, &str)> = None;
    for candidate in candidates {
        if candidate == typed || candidate.is_empty() || candidate.len() > MAX_LEN {
            continue;
        }
        let edits = edits(typed, candidate);
        let longer = typed.chars().count().max(candidate.chars().count());
        let shorter = typed.chars().count().min(candidate.chars().count());
        let prefix = shorter >= MIN_PREFIX && (typed.starts_with(candidate) || candidate.starts_with(typed));
        // A word of four letters or fewer is a typo of one edit: two make
        // too many of them near each other (`make` and `image`).
        let most = if typed.chars().count() <= 4 { 1 } else { MAX_EDITS };
        if ((edits <= most && edits * 2 <= longer) || prefix) && best.is_none_or(|(fewest, _)| edits < fewest) {
            best = Some((edits, candidate));
        }
    }
    best.map(|(_, name)| name)
}

/// The Levenshtein distance between `a` and `b`, by characters.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    // One row of the table at a time: row[j] is the distance from the prefix
    // of `a` read so far to the first j characters of `b`.
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = i;
        let mut left = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row.get(j + 1).copied().unwrap_or(usize::MAX);
            let here = if ca == *cb { diagonal } else { 1 + diagonal.min(above).min(left) };
            diagonal = above;
            if let Some(cell) = row.get_mut(j + 1) {
                *cell = here;
            }
            left = here;
        }
        if let Some(first) = row.first_mut() {
            *first = i + 1;
        }
    }
    row.last().copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_edits() {
        assert_eq!(edits("b11", "b1"), 1);
        assert_eq!(edits("lst", "ls"), 1);
        assert_eq!(edits("kitten", "sitting"), 3);
        assert_eq!(edits("", "abc"), 3);
        assert_eq!(edits("root", "foo"), 2);
        assert_eq!(edits("same", "same"), 0);
    }

    #[test]
    fn finds_the_likely_typo() {
        assert_eq!(closest("b11", ["web", "b1", "b2"]), Some("b1"));
        assert_eq!(closest("lst", ["new", "ls", "list"]), Some("ls"));
        assert_eq!(closest("chekpoint", ["checkpoints", "checkpoint"]), Some("checkpoint"));
        // A prefix either way, however many letters it leaves out.
        assert_eq!(closest("web", ["webserver-1"]), Some("webserver-1"));
        assert_eq!(closest("webserver-1-old", ["webserver-1"]), Some("webserver-1"));
        assert_eq!(closest("make", ["new", "ls", "rm", "info", "dup"]), None);
        // Two edits of a short word are no typo: `cat` is not `set`, `x` not `ls`.
        assert_eq!(closest("cat", ["set"]), None);
        assert_eq!(closest("x", ["ls", "rm"]), None);
        assert_eq!(closest("b2", ["b1"]), Some("b1"));
        assert_eq!(closest("root", ["ctl-3", "first", "route-12"]), None);
        // A prefix of one or two letters is too short to be meant: the local
        // user `root` reaches the control plane with boxes `r` and `ro`.
        assert_eq!(closest("root", ["r", "ro"]), None);
        assert_eq!(closest("r", ["root"]), None);
        assert_eq!(closest("root", ["roo"]), Some("roo"));
        assert_eq!(closest("b1", ["b1"]), None);
        assert_eq!(closest("", ["a"]), None);
        assert_eq!(closest(&"a".repeat(65), ["a"]), None);
    }
}
