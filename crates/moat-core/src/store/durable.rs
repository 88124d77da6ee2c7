//! Durable boxes' records: each box's root kept in an object store as a chain
//! of `btrfs send` streams (a full one, then incrementals, each against the
//! link before it). A link is recorded only once its object is complete in
//! the object store, so every recorded link can be fetched; a crash mid-upload
//! leaves at most an object no record names.
//!
//! A link sent from a checkpoint carries the checkpoint's label for as long
//! as the checkpoint exists, so that a box received elsewhere gets its
//! checkpoints back, and the collector keeps the links they need.
//!
//! Pulled and saved images are kept there too, each as one full stream
//! under its pool key, recorded once its upload is complete: a node that
//! lacks an image fetches it on first use.

use serde::{Deserialize, Serialize};

use super::sql::{args, Row};
use super::{Store, StoreError};
use crate::ids::BoxId;

/// One stream of a box's chain, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurableLink {
    /// The box.
    pub box_id: BoxId,
    /// Its place in the box's chain, from 0; strictly increasing.
    pub seq: u64,
    /// The link it is an incremental against (`None`: a full stream).
    pub parent_seq: Option<u64>,
    /// The object's key in the object store (never overwritten).
    pub key: String,
    /// The read-only snapshot it was sent from (its name on the node that
    /// sent it, and the name `btrfs receive` gives it).
    pub snapshot: String,
    /// SHA-256 of the object's bytes, hex.
    pub sha256: String,
    /// The object's size (compressed).
    pub bytes: u64,
    /// When its snapshot was taken: the box is durable as of then (ms).
    pub taken_at_ms: u64,
    /// When its upload completed (ms).
    pub uploaded_at_ms: u64,
    /// The node that uploaded it.
    pub node: String,
    /// The checkpoint it was sent from, while that checkpoint exists
    /// (`None`: sent from the box's root, or the checkpoint is gone).
    pub checkpoint: Option<String>,
}

const COLUMNS: &str =
    "box_id, seq, parent_seq, key, snapshot, sha256, bytes, taken_at_ms, uploaded_at_ms, node, checkpoint";

fn link_from_row(r: &Row) -> Result<DurableLink, StoreError> {
    let id: String = r.get(0)?;
    Ok(DurableLink {
        box_id: BoxId::parse(&id).ok_or_else(|| StoreError::Corrupt(id.clone()))?,
        seq: r.get(1)?,
        parent_seq: r.get(2)?,
        key: r.get(3)?,
        snapshot: r.get(4)?,
        sha256: r.get(5)?,
        bytes: r.get(6)?,
        taken_at_ms: r.get(7)?,
        uploaded_at_ms: r.get(8)?,
        node: r.get(9)?,
        checkpoint: r.get(10)?,
    })
}

/// An image kept in the object store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurableImage {
    /// Its pool key (what boxes are snapshots of).
    pub key: String,
    /// The object's key in the object store (never overwritten).
    pub object: String,
    /// SHA-256 of the object's bytes, hex.
    pub sha256: String,
    /// The object's size (compressed).
    pub bytes: u64,
    /// When its upload completed (ms).
    pub uploaded_at_ms: u64,
    /// The node that uploaded it.
    pub node: String,
}

const IMAGE_COLUMNS: &str = "key, object, sha256, bytes, uploaded_at_ms, node";

fn image_from_row(r: &Row) -> Result<DurableImage, StoreError> {
    Ok(DurableImage {
        key: r.get(0)?,
        object: r.get(1)?,
        sha256: r.get(2)?,
        bytes: r.get(3)?,
        uploaded_at_ms: r.get(4)?,
        node: r.get(5)?,
    })
}

impl Store {
    /// Records `image`, whose object is complete in the object store, unless
    /// one is recorded for its key already (another node uploaded it
    /// first: then this object is no record's). Whether it was recorded.
    pub fn add_durable_image(&self, image: &DurableImage) -> Result<bool, StoreError> {
        let added = self.execute(
            &format!(
                "INSERT INTO durable_images ({IMAGE_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (key) DO NOTHING"
            ),
            &args![&image.key, &image.object, &image.sha256, image.bytes, image.uploaded_at_ms, &image.node],
        )?;
        Ok(added == 1)
    }

    /// The image kept in the object store under pool key `key`, if any.
    pub fn durable_image(&self, key: &str) -> Result<Option<DurableImage>, StoreError> {
        let sql = format!("SELECT {IMAGE_COLUMNS} FROM durable_images WHERE key = ?1");
        self.query_row(&sql, &args![key])?.as_ref().map(image_from_row).transpose()
    }

    /// Every image kept in the object store.
    pub fn durable_images(&self) -> Result<Vec<DurableImage>, StoreError> {
        let sql = format!("SELECT {IMAGE_COLUMNS} FROM durable_images ORDER BY key");
        self.query(&sql, &[])?.iter().map(image_from_row).collect()
    }

    /// Whether any image of anyone's has pool key `key` (its object is needed).
    pub fn image_key_in_use(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self.query_row("SELECT 1 FROM images WHERE key = ?1 LIMIT 1", &args![key])?.is_some())
    }

    /// Forgets the image kept under `key` (its object is to be deleted).
    pub fn forget_durable_image(&self, key: &str) -> Result<(), StoreError> {
        self.execute("DELETE FROM durable_images WHERE key = ?1", &args![key])?;
        Ok(())
    }

    /// Records `link`, whose object is complete in the object store. Fails if
    /// the box already has a link at its place (another uploader got there).
    pub fn add_durable_link(&self, link: &DurableLink) -> Result<(), StoreError> {
        self.execute(
            &format!("INSERT INTO durable_links ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"),
            &args![
                link.box_id.as_str(),
                link.seq,
                link.parent_seq,
                &link.key,
                &link.snapshot,
                &link.sha256,
                link.bytes,
                link.taken_at_ms,
                link.uploaded_at_ms,
                &link.node,
                link.checkpoint.as_deref()
            ],
        )?;
        Ok(())
    }

    /// Box `id`'s chain, oldest first.
    pub fn durable_links(&self, id: &BoxId) -> Result<Vec<DurableLink>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM durable_links WHERE box_id = ?1 ORDER BY seq");
        self.query(&sql, &args![id.as_str()])?.iter().map(link_from_row).collect()
    }

    /// Box `id`'s newest link, if it has one.
    pub fn durable_head(&self, id: &BoxId) -> Result<Option<DurableLink>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM durable_links WHERE box_id = ?1 ORDER BY seq DESC LIMIT 1");
        self.query_row(&sql, &args![id.as_str()])?.as_ref().map(link_from_row).transpose()
    }

    /// Forgets box `id`'s links at places `seqs` (their objects are to be deleted).
    pub fn forget_durable_links(&self, id: &BoxId, seqs: &[u64]) -> Result<(), StoreError> {
        self.transaction(|tx| {
            for seq in seqs {
                tx.execute("DELETE FROM durable_links WHERE box_id = ?1 AND seq = ?2", &args![id.as_str(), *seq])?;
            }
            Ok(())
        })
    }

    /// Box `id`'s checkpoint `label` is gone: no link carries it any more
    /// (the links only it needed become garbage).
    pub fn forget_durable_checkpoint(&self, id: &BoxId, label: &str) -> Result<(), StoreError> {
        self.execute(
            "UPDATE durable_links SET checkpoint = NULL WHERE box_id = ?1 AND checkpoint = ?2",
            &args![id.as_str(), label],
        )?;
        Ok(())
    }

    /// Forgets every link of box `id` (removed: its objects are deleted).
    pub fn forget_durable(&self, id: &BoxId) -> Result<(), StoreError> {
        self.execute("DELETE FROM durable_links WHERE box_id = ?1", &args![id.as_str()])?;
        Ok(())
    }

    /// Bytes box `id` keeps in the object store.
    pub fn durable_bytes(&self, id: &BoxId) -> Result<u64, StoreError> {
        let row = self.query_row(
            "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM durable_links WHERE box_id = ?1",
            &args![id.as_str()],
        )?;
        Ok(row.map(|r| r.get(0)).transpose()?.unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{on_both_engines, TestDb};

    on_both_engines!(
        links_are_kept_in_order_and_a_place_is_taken_once,
        a_checkpoints_label_stays_on_its_link_until_it_is_gone,
        an_image_is_recorded_once_by_whichever_node_uploads_it_first
    );

    fn an_image_is_recorded_once_by_whichever_node_uploads_it_first(db: &TestDb) {
        let store = db.open();
        let image = |node: &str| DurableImage {
            key: "oci-abc".into(),
            object: format!("p/images/oci-abc-{node}.btrfs.zst"),
            sha256: "cd".repeat(32),
            bytes: 7,
            uploaded_at_ms: 8,
            node: node.into(),
        };
        assert_eq!(store.durable_image("oci-abc").unwrap(), None);
        assert!(store.add_durable_image(&image("n1")).unwrap());
        assert!(!store.add_durable_image(&image("n2")).unwrap(), "the first upload stays the image's");
        assert_eq!(db.open().durable_image("oci-abc").unwrap(), Some(image("n1")));
        assert_eq!(store.durable_images().unwrap(), [image("n1")]);
        store.forget_durable_image("oci-abc").unwrap();
        assert!(store.durable_images().unwrap().is_empty());
    }

    fn link(id: &BoxId, seq: u64, parent_seq: Option<u64>) -> DurableLink {
        DurableLink {
            box_id: id.clone(),
            seq,
            parent_seq,
            key: format!("p/boxes/{id}/{seq}"),
            snapshot: format!("s{seq}"),
            sha256: "ab".repeat(32),
            bytes: 1000 + seq,
            taken_at_ms: 10 + seq,
            uploaded_at_ms: 20 + seq,
            node: "n1".into(),
            checkpoint: None,
        }
    }

    fn links_are_kept_in_order_and_a_place_is_taken_once(db: &TestDb) {
        let store = db.open();
        let (a, b) = (BoxId::random(), BoxId::random());
        assert_eq!(store.durable_head(&a).unwrap(), None);
        for l in [link(&a, 1, Some(0)), link(&a, 0, None), link(&b, 0, None)] {
            store.add_durable_link(&l).unwrap();
        }
        assert!(store.add_durable_link(&link(&a, 1, Some(0))).is_err());
        let chain = store.durable_links(&a).unwrap();
        assert_eq!(chain, vec![link(&a, 0, None), link(&a, 1, Some(0))]);
        assert_eq!(store.durable_head(&a).unwrap(), Some(link(&a, 1, Some(0))));
        assert_eq!(store.durable_bytes(&a).unwrap(), 2001);
        drop(store);
        assert_eq!(db.open().durable_links(&b).unwrap(), vec![link(&b, 0, None)]);
    }

    fn a_checkpoints_label_stays_on_its_link_until_it_is_gone(db: &TestDb) {
        let store = db.open();
        let id = BoxId::random();
        let c1 = DurableLink { checkpoint: Some("c1".into()), ..link(&id, 1, Some(0)) };
        for l in [link(&id, 0, None), c1.clone(), link(&id, 2, Some(1)), link(&id, 3, None)] {
            store.add_durable_link(&l).unwrap();
        }
        assert_eq!(store.durable_links(&id).unwrap()[1], c1);
        store.forget_durable_checkpoint(&id, "c2").unwrap();
        assert_eq!(store.durable_links(&id).unwrap()[1].checkpoint.as_deref(), Some("c1"));
        store.forget_durable_checkpoint(&id, "c1").unwrap();
        assert_eq!(store.durable_links(&id).unwrap()[1].checkpoint, None);
        store.forget_durable_links(&id, &[0, 2]).unwrap();
        let seqs: Vec<u64> = store.durable_links(&id).unwrap().iter().map(|l| l.seq).collect();
        assert_eq!(seqs, [1, 3]);
    }
}
