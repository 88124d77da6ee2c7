//! The daemon's side of `image push`: an image of the account's written to
//! a registry as an OCI image. A template (a box saved) is its base's layers
//! and one layer more: what the box added, changed and deleted (whiteouts),
//! from the btrfs trees (the base's top layer against the template), packed
//! here as a gzip'd tar ([`moat_oci::pack`]). The base's layers are not sent:
//! moat keeps no pulled blob, so each must be in the target repository
//! already, or be mounted there from the repository it was pulled from (the
//! same registry). The registry is spoken to by the unprivileged fetcher
//! ([`crate::image_fetch`]), as for a pull; it is handed each blob's file.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use moat_api::Packets;
use moat_box::layers;
use moat_core::backend::Progress;
use moat_core::manager::Logins;
use moat_core::store::images::StoredImage;
use moat_core::ChangeKind;
use moat_oci::digest::Digest;
use moat_oci::pack::{pack, Changed, Packed};
use moat_oci::Reference;
use serde_json::{json, Value};

use crate::image_fetch::{FetchHello, FromFetch, ToFetch};
use crate::image_pull::{next, Puller};

/// The media types of a Docker schema 2 image's parts, and of an OCI one's.
const DOCKER: [&str; 3] = [
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.container.image.v1+json",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
];
const OCI: [&str; 3] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.oci.image.layer.v1.tar+gzip",
];

/// A blob made here, in a file of the pool's `pushes` directory (removed on drop).
struct Made {
    path: PathBuf,
    digest: Digest,
    size: u64,
}

impl Drop for Made {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Puller {
    /// Pushes `image` to `text`; the line that says what was pushed.
    pub fn push_image(
        &self,
        image: &StoredImage,
        text: &str,
        logins: Logins<'_>,
        progress: Progress<'_>,
    ) -> Result<String> {
        // Its files are its own (random names); the layers it reads are sealed.
        self.runtime.block_on(self.push_async(image, text, logins, progress))
    }

    async fn push_async(
        &self,
        image: &StoredImage,
        text: &str,
        logins: Logins<'_>,
        progress: Progress<'_>,
    ) -> Result<String> {
        let target = Reference::parse(text, self.default_registry.as_deref())?;
        ensure!(target.digest.is_none(), "push to a tag (REGISTRY/REPO:TAG), not to a digest");
        let base: Value = match image.base_manifest.as_str() {
            "" if !image.layers.is_empty() => {
                bail!("image {} was pulled before moat kept manifests: pull its base again, then push", image.name)
            }
            "" => Value::Null,
            text => serde_json::from_str(text).context("the base's manifest")?,
        };
        let base_layers: Vec<Value> = base["layers"].as_array().cloned().unwrap_or_default();
        let docker = base["mediaType"].as_str() == Some(DOCKER[0]);
        let [manifest_type, config_type, layer_type] = if docker { DOCKER } else { OCI };

        // What a template adds, as one layer.
        let added = if image.digest == "-" { self.pack_template(image, progress)? } else { None };
        let mut config: Value = serde_json::from_str(&image.config).unwrap_or(Value::Null);
        if !config.is_object() {
            config = json!({"architecture": "amd64", "os": "linux", "config": {}});
        }
        if !config["rootfs"].is_object() {
            config["rootfs"] = json!({"type": "layers", "diff_ids": []});
        }
        if let Some((packed, _)) = &added {
            if let Some(ids) = config["rootfs"]["diff_ids"].as_array_mut() {
                ids.push(json!(packed.diff_id.as_str()));
            }
            if let Some(history) = config["history"].as_array_mut() {
                history.push(json!({"created_by": format!("moat image save ({})", image.reference)}));
            }
        }
        let config_bytes = serde_json::to_vec(&config)?;
        let config_blob = self.blob_file(&config_bytes)?;
        let mut layer_descs = base_layers.clone();
        if let Some((packed, _)) = &added {
            layer_descs.push(json!({"mediaType": layer_type, "digest": packed.digest.as_str(), "size": packed.size}));
        }
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": manifest_type,
            "config": {"mediaType": config_type, "digest": config_blob.digest.as_str(), "size": config_blob.size},
            "layers": layer_descs,
        });
        let manifest = serde_json::to_string(&manifest)?;
        let manifest_digest = Digest::of(manifest.as_bytes());

        let hello = FetchHello {
            upstream: self.upstream.clone(),
            reference: target.to_string(),
            default_registry: self.default_registry.clone(),
            logins: logins(&target.registry).into_iter().collect(),
            bounds: self.bounds,
            push: true,
        };
        let (_fetcher, link) = self.start_fetcher(&hello).await?;
        let FromFetch::Ready = next(&link, progress).await? else { bail!("the fetcher answered out of turn") };

        // The base's layers: in the repository, or mounted from where they came.
        let source = Reference::parse(&image.base_source, None).ok().filter(|s| s.registry == target.registry);
        let count = base_layers.len() + usize::from(added.is_some());
        for (i, layer) in base_layers.iter().enumerate() {
            let digest: Digest = serde_json::from_value(layer["digest"].clone()).context("a base layer's digest")?;
            let label = format!("layer {}/{count} {}", i + 1, digest.short());
            if ask(&link, &ToFetch::HasBlob(digest.clone()), progress).await? {
                progress(&format!("{label}: there already"));
                continue;
            }
            if let Some(source) = &source {
                let mount = ToFetch::Mount { digest: digest.clone(), from: source.repository.clone() };
                if ask(&link, &mount, progress).await? {
                    progress(&format!("{label}: mounted from {}", source.repository));
                    continue;
                }
            }
            bail!(
                "{label} of the base is not in {}/{} and the registry would not mount it there: moat keeps no \
                 copy of pulled layers (push to the registry the base was pulled from)",
                target.registry,
                target.repository
            );
        }
        if let Some((packed, file)) = &added {
            let label = format!("layer {count}/{count} {} (what {} adds)", packed.digest.short(), image.name);
            self.send_blob(&link, file, &label, progress).await?;
        }
        self.send_blob(&link, &config_blob, "the image config", progress).await?;
        let put = ToFetch::PutManifest { media_type: manifest_type.to_string(), manifest };
        link.send(&serde_json::to_vec(&put)?, &[]).await?;
        let FromFetch::Done = next(&link, progress).await? else { bail!("the fetcher answered out of turn") };
        Ok(format!("pushed {target} ({manifest_digest})"))
    }

    /// Sends `blob` unless the repository has it.
    async fn send_blob(&self, link: &Packets, blob: &Made, label: &str, progress: Progress<'_>) -> Result<()> {
        if ask(link, &ToFetch::HasBlob(blob.digest.clone()), progress).await? {
            progress(&format!("{label}: there already"));
            return Ok(());
        }
        let file = std::fs::File::open(&blob.path)?;
        let upload = ToFetch::Upload { digest: blob.digest.clone(), label: label.to_string() };
        link.send(&serde_json::to_vec(&upload)?, &[file.as_fd()]).await?;
        let FromFetch::Done = next(link, progress).await? else { bail!("the fetcher answered out of turn") };
        Ok(())
    }

    /// Writes `bytes` as a blob file.
    fn blob_file(&self, bytes: &[u8]) -> Result<Made> {
        let path = self.scratch("config")?;
        let made = Made { path, digest: Digest::of(bytes), size: bytes.len() as u64 };
        std::fs::write(&made.path, bytes)?;
        Ok(made)
    }

    /// A new file's path in the pool's `pushes` directory (a pull's blobs
    /// directory is its own: what is left there is a pull's leftover).
    fn scratch(&self, what: &str) -> Result<PathBuf> {
        let dir = self.pool.root().join("pushes");
        std::fs::create_dir_all(&dir)?;
        Ok(dir.join(format!("push-{what}-{}", moat_core::ids::BoxId::random())))
    }

    /// The layer of what template `image` adds to its base's top layer (or,
    /// made from a built-in image, its whole tree); `None` if it adds nothing.
    fn pack_template(&self, image: &StoredImage, progress: Progress<'_>) -> Result<Option<(Packed, Made)>> {
        let tree = self.pool.image_path(&image.key);
        let empty = self.scratch("empty")?;
        std::fs::create_dir(&empty)?;
        let base = match image.layers.last() {
            Some(top) => layers::dir(&self.pool).join(top),
            None => empty.clone(),
        };
        progress(&format!("{}: finding what it adds to its base", image.name));
        let changes = changes(&base, &tree);
        let _ = std::fs::remove_dir(&empty);
        let changes = changes?;
        if changes.is_empty() {
            return Ok(None);
        }
        let path = self.scratch("layer")?;
        let file = std::fs::File::options().write(true).create_new(true).open(&path)?;
        let root: std::os::fd::OwnedFd = std::fs::File::open(&tree)?.into();
        let packed = pack(&root, &changes, std::io::BufWriter::new(file), self.bounds.max_image);
        let packed = match packed {
            Ok(packed) => packed,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e).with_context(|| format!("pack what {} adds", image.name));
            }
        };
        let made = Made { path, digest: packed.digest.clone(), size: packed.size };
        let skipped = if packed.skipped > 0 {
            format!(", {} device nodes or sockets left out", packed.skipped)
        } else {
            String::new()
        };
        progress(&format!(
            "{}: {} changes in one layer of {}{skipped}",
            image.name,
            changes.len(),
            moat_core::limits::format_measured(packed.size)
        ));
        Ok(Some((packed, made)))
    }
}

/// What changed from `base` to `tree`, as a layer names it. A name that is
/// not UTF-8 is refused: the comparison spells its bytes as U+FFFD, and
/// the layer would carry another file under it (or none).
fn changes(base: &Path, tree: &Path) -> Result<Vec<Changed>> {
    let mut changes = Vec::new();
    let mut unnamed = None;
    let mut whiteout = None;
    moat_box::diff::diff(base, tree, &mut |batch| {
        if let Some(c) = batch.iter().find(|c| c.path.contains('\u{FFFD}')) {
            unnamed = Some(c.path.clone());
            return false;
        }
        // Every reader of a layer takes `.wh.NAME` for NAME deleted (and
        // `.wh..wh..opq` for its directory emptied): carried as a file, it
        // would delete the base's files from the image pulled back.
        if let Some(c) = batch.iter().find(|c| c.path.split('/').any(|part| part.starts_with(".wh."))) {
            whiteout = Some(c.path.clone());
            return false;
        }
        changes.extend(batch.into_iter().map(|c| {
            let path = c.path.trim_start_matches('/').to_string();
            match c.change {
                ChangeKind::Deleted => Changed::Deleted(path),
                ChangeKind::Added | ChangeKind::Modified => Changed::Present(path),
            }
        }));
        true
    })
    .map_err(|e| match (&unnamed, &whiteout) {
        (Some(path), _) => anyhow::anyhow!(
            "{} has a name that is not UTF-8 (shown with U+FFFD): a layer cannot carry it here; rename it and \
             save the template again",
            path.escape_default()
        ),
        (None, Some(path)) => anyhow::anyhow!(
            "{} has a name starting with .wh., which an image layer reads as a deletion: rename it and save the \
             template again",
            path.escape_default()
        ),
        (None, None) => anyhow::Error::new(e).context("compare the template with its base"),
    })?;
    Ok(changes)
}

/// Asks the fetcher a yes-or-no question.
async fn ask(link: &Packets, question: &ToFetch, progress: Progress<'_>) -> Result<bool> {
    link.send(&serde_json::to_vec(question)?, &[]).await?;
    match next(link, progress).await? {
        FromFetch::Answer(yes) => Ok(yes),
        _ => bail!("the fetcher answered out of turn"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_name_that_is_not_utf8_is_refused_not_mistaken() {
        use std::os::unix::ffi::OsStrExt;
        let (base, tree) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::write(tree.path().join("fine"), b"x").unwrap();
        assert_eq!(changes(base.path(), tree.path()).unwrap(), [Changed::Present("fine".into())]);
        std::fs::write(tree.path().join(std::ffi::OsStr::from_bytes(b"bad\xffname")), b"y").unwrap();
        let refused = changes(base.path(), tree.path()).unwrap_err().to_string();
        assert!(refused.starts_with("/bad\\u{fffd}name has a name that is not UTF-8"), "{refused}");
    }

    #[test]
    fn a_name_a_layer_reads_as_a_whiteout_is_refused() {
        let (base, tree) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::create_dir(tree.path().join("srv")).unwrap();
        std::fs::write(tree.path().join("srv/.wh.keep"), b"").unwrap();
        let refused = changes(base.path(), tree.path()).unwrap_err().to_string();
        assert!(refused.starts_with("/srv/.wh.keep has a name starting with .wh."), "{refused}");
    }
}
