//! A box's chain of streams: which upload comes next (a full stream, or an
//! incremental against the newest link whose snapshot this node still has),
//! what a restore replays (the newest full stream and every incremental
//! after it, each against the one before), and the keys objects get.
//! Pure: decided from the store's records alone.

use moat_core::ids::BoxId;
use moat_core::store::durable::DurableLink;

/// A chain that cannot be replayed (the records were edited, or a link is missing).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    /// The box was never made durable.
    #[error("box {0} has nothing in the object store")]
    Empty(String),
    /// A link is not against the one before it.
    #[error("box {box_id}'s chain is broken at link {seq}: it is against {parent:?}, the link before is {before:?}")]
    Broken {
        /// The box.
        box_id: String,
        /// The link.
        seq: u64,
        /// What it is against.
        parent: Option<u64>,
        /// The link before it.
        before: Option<u64>,
    },
}

/// What the next upload of a box is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextLink {
    /// Its place in the chain.
    pub seq: u64,
    /// The link it is an incremental against (`None`: a full stream).
    pub parent: Option<DurableLink>,
}

/// The next upload after `links` (oldest first): an incremental against the
/// newest link if this node still has that link's snapshot (`have_snapshot`)
/// and fewer than `full_every` links follow the newest full one; else a full.
pub fn next_link(links: &[DurableLink], full_every: u64, have_snapshot: impl Fn(&str) -> bool) -> NextLink {
    let seq = links.last().map_or(0, |l| l.seq + 1);
    let since_full = links.iter().rev().take_while(|l| l.parent_seq.is_some()).count() as u64 + 1;
    let parent = links.last().filter(|head| since_full < full_every.max(1) && have_snapshot(&head.snapshot)).cloned();
    NextLink { seq, parent }
}

/// The links a restore replays, oldest first: the newest full stream and
/// every link after it (the box's root), and for each link sent from a
/// checkpoint, the full stream before it and the links between; each link
/// an incremental against the one before it in the plan.
pub fn restore_plan(links: &[DurableLink]) -> Result<Vec<&DurableLink>, ChainError> {
    if links.is_empty() {
        return Err(ChainError::Empty(String::new()));
    }
    let plan: Vec<&DurableLink> = needed(links).into_iter().filter_map(|i| links.get(i)).collect();
    // Every incremental is against the link before it in the plan.
    for (i, link) in plan.iter().enumerate() {
        let before = i.checked_sub(1).and_then(|b| plan.get(b)).map(|b| b.seq);
        if link.parent_seq.is_some() && link.parent_seq != before {
            return Err(ChainError::Broken {
                box_id: link.box_id.to_string(),
                seq: link.seq,
                parent: link.parent_seq,
                before,
            });
        }
    }
    Ok(plan)
}

/// The places (indices into `links`) a restore needs: see [`restore_plan`].
/// What the collector may delete is every other link.
pub fn needed(links: &[DurableLink]) -> Vec<usize> {
    let mut needed: Vec<usize> = needed_runs(links).into_iter().flat_map(|(start, end)| start..=end).collect();
    needed.sort_unstable();
    needed.dedup();
    needed
}

/// The runs of links a restore needs, as (first, last) indices: from the
/// full stream at or before the head, and at or before each checkpoint's
/// link, to that link. A run without a full stream before it starts at 0
/// (and [`restore_plan`] refuses it as broken).
fn needed_runs(links: &[DurableLink]) -> Vec<(usize, usize)> {
    let full_at_or_before = |end: usize| links.get(..=end).and_then(|l| l.iter().rposition(|l| l.parent_seq.is_none()));
    let ends = links
        .iter()
        .enumerate()
        .filter(|(_, l)| l.checkpoint.is_some())
        .map(|(i, _)| i)
        .chain(links.len().checked_sub(1));
    ends.map(|end| (full_at_or_before(end).unwrap_or(0), end)).collect()
}

/// The key of link `seq` of box `id`, sent from snapshot `snapshot` (a name
/// no other upload uses, so no key is ever written twice).
pub fn object_key(prefix: &str, id: &BoxId, seq: u64, snapshot: &str, full: bool) -> String {
    let kind = if full { "full" } else { "incr" };
    crate::under(prefix, &format!("boxes/{id}/{seq:010}-{kind}-{snapshot}.btrfs.zst"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(id: &BoxId, seq: u64, parent_seq: Option<u64>) -> DurableLink {
        DurableLink {
            box_id: id.clone(),
            seq,
            parent_seq,
            key: format!("k{seq}"),
            snapshot: format!("s{seq}"),
            sha256: String::new(),
            bytes: 0,
            taken_at_ms: seq,
            uploaded_at_ms: seq,
            node: String::new(),
            checkpoint: None,
        }
    }

    fn seqs(plan: &[&DurableLink]) -> Vec<u64> {
        plan.iter().map(|l| l.seq).collect()
    }

    #[test]
    fn the_first_upload_is_full_then_incrementals_until_a_new_full_is_due() {
        let id = BoxId::random();
        let all = |_: &str| true;
        assert_eq!(next_link(&[], 3, all), NextLink { seq: 0, parent: None });
        let mut links = vec![link(&id, 0, None)];
        assert_eq!(next_link(&links, 3, all).parent, Some(link(&id, 0, None)));
        links.push(link(&id, 1, Some(0)));
        assert_eq!(next_link(&links, 3, all), NextLink { seq: 2, parent: Some(link(&id, 1, Some(0))) });
        links.push(link(&id, 2, Some(1)));
        // Three links since the full one: the next is a full.
        assert_eq!(next_link(&links, 3, all), NextLink { seq: 3, parent: None });
        links.push(link(&id, 3, None));
        assert_eq!(next_link(&links, 3, all).parent, Some(link(&id, 3, None)));
        // Every upload full.
        assert_eq!(next_link(&links, 1, all).parent, None);
        assert_eq!(next_link(&links, 0, all).parent, None);
    }

    #[test]
    fn without_the_parent_snapshot_here_the_next_upload_is_full() {
        let id = BoxId::random();
        let links = vec![link(&id, 0, None), link(&id, 1, Some(0))];
        assert_eq!(next_link(&links, 10, |s| s == "s0"), NextLink { seq: 2, parent: None });
        assert_eq!(next_link(&links, 10, |s| s == "s1").parent, Some(link(&id, 1, Some(0))));
    }

    #[test]
    fn a_restore_replays_from_the_newest_full_stream() {
        let id = BoxId::random();
        assert!(matches!(restore_plan(&[]), Err(ChainError::Empty(_))));
        let links = vec![
            link(&id, 0, None),
            link(&id, 1, Some(0)),
            link(&id, 2, None),
            link(&id, 3, Some(2)),
            link(&id, 4, Some(3)),
        ];
        assert_eq!(seqs(&restore_plan(&links).unwrap()), [2, 3, 4]);
        assert_eq!(needed(&links), [2, 3, 4]);
        assert_eq!(restore_plan(&links[..1]).unwrap().len(), 1);
    }

    #[test]
    fn a_checkpoints_link_keeps_the_run_from_its_full_stream() {
        let id = BoxId::random();
        let checkpoint = |l: DurableLink| DurableLink { checkpoint: Some(format!("c{}", l.seq)), ..l };
        let links = vec![
            link(&id, 0, None),
            checkpoint(link(&id, 1, Some(0))),
            link(&id, 2, Some(1)),
            link(&id, 3, None),
            link(&id, 4, Some(3)),
            link(&id, 5, None),
            checkpoint(link(&id, 6, Some(5))),
            link(&id, 7, Some(6)),
        ];
        // c1 needs 0-1; c6 and the head need 5-7; 2, 3 and 4 are garbage.
        assert_eq!(seqs(&restore_plan(&links).unwrap()), [0, 1, 5, 6, 7]);
        assert_eq!(needed(&links), [0, 1, 5, 6, 7]);
        // A checkpoint at the head: one run.
        assert_eq!(seqs(&restore_plan(&links[..7]).unwrap()), [0, 1, 5, 6]);
        // Its full stream lost from the records: refused, never half replayed.
        assert!(matches!(restore_plan(&links[1..]), Err(ChainError::Broken { seq: 1, .. })));
    }

    #[test]
    fn a_broken_chain_is_refused() {
        let id = BoxId::random();
        let gap = vec![link(&id, 0, None), link(&id, 2, Some(1))];
        assert!(matches!(restore_plan(&gap), Err(ChainError::Broken { seq: 2, .. })));
        let no_full = vec![link(&id, 1, Some(0)), link(&id, 2, Some(1))];
        assert!(matches!(restore_plan(&no_full), Err(ChainError::Broken { .. })));
    }

    #[test]
    fn keys_name_the_box_the_place_and_the_snapshot() {
        let id = BoxId::random();
        assert_eq!(object_key("p/q", &id, 7, "s", true), format!("p/q/boxes/{id}/0000000007-full-s.btrfs.zst"));
        assert_eq!(object_key("", &id, 8, "t", false), format!("boxes/{id}/0000000008-incr-t.btrfs.zst"));
    }
}
