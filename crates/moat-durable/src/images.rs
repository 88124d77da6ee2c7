//! Images in the object store: a pulled or saved image's subvolume sent
//! whole (`btrfs send`, compressed, hashed) under a key of its own and
//! recorded once the upload is complete; a node that lacks the image
//! fetches it on first use, checks it before `btrfs receive` sees a byte,
//! and keeps a read-only snapshot of what it received as the image (so
//! `new` and `dup` stay local snapshots).

use std::path::Path;
use std::sync::Arc;

use moat_box::sys;
use moat_core::clock::now_ms;
use moat_core::store::durable::DurableImage;
use object_store::ObjectStore;

use crate::restore::{fetch_verified, receive_file, Incoming};
use crate::upload::Uploader;
use crate::{io_err, DurableError};

/// The key an upload of image `key` goes to (`rand`: this upload's own).
pub fn object_key(prefix: &str, key: &str, rand: &str) -> String {
    crate::under(prefix, &format!("images/{key}-{rand}.btrfs.zst"))
}

/// Uploads image `key` (its subvolume in `images_dir`): the record to keep.
pub async fn upload_image(uploader: &Uploader, images_dir: &Path, key: &str) -> Result<DurableImage, DurableError> {
    let image = images_dir.join(key);
    if !image.is_dir() {
        return Err(DurableError::Config(format!("image {key} is not on this node")));
    }
    let rand = crate::unique_name();
    // Sent from a read-only snapshot named as the image, whatever the
    // image's own subvolume is: what a receive makes is then named `key`.
    let out = uploader.snapshots.join("images").join(&rand);
    std::fs::create_dir_all(&out).map_err(io_err(format!("create {}", out.display())))?;
    let sent = async {
        sys::subvolume_snapshot(&image, &out, key, true).map_err(io_err(format!("snapshot image {key} read-only")))?;
        let object = object_key(&uploader.prefix, key, &rand);
        let packed = uploader.send(&out.join(key), None, &object).await?;
        Ok(DurableImage {
            key: key.to_string(),
            object,
            sha256: packed.sha256,
            bytes: packed.bytes,
            uploaded_at_ms: now_ms(),
            node: uploader.node.clone(),
        })
    };
    let sent = sent.await;
    let _ = sys::subvolume_delete(&out, key);
    let _ = std::fs::remove_dir(&out);
    sent
}

/// Fetches `image` into `images_dir` (staging in `staging`, on the same
/// btrfs filesystem). On any failure nothing is left.
pub async fn fetch_image(
    store: &Arc<dyn ObjectStore>,
    image: &DurableImage,
    staging: &Path,
    images_dir: &Path,
) -> Result<(), DurableError> {
    let incoming = Incoming::new(staging, &image.key)?;
    let file = incoming.dir.join("image.zst");
    fetch_verified(store, (&image.object, &image.sha256), &file).await?;
    receive_file(file, incoming.dir.clone(), image.object.clone()).await?;
    let received = incoming.dir.join(&image.key);
    if !received.is_dir() {
        return Err(DurableError::Config(format!(
            "object {} received no subvolume {} (not this image's stream?)",
            image.object, image.key
        )));
    }
    std::fs::create_dir_all(images_dir).map_err(io_err(format!("create {}", images_dir.display())))?;
    sys::subvolume_snapshot(&received, images_dir, &image.key, true)
        .map_err(io_err(format!("keep image {} read-only", image.key)))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn image_keys_name_the_image_and_the_upload() {
        assert_eq!(super::object_key("p", "oci-1", "9-ab"), "p/images/oci-1-9-ab.btrfs.zst");
        assert_eq!(super::object_key("", "oci-1", "9-ab"), "images/oci-1-9-ab.btrfs.zst");
    }
}
