//! The documents a registry serves about an image: an index (a manifest
//! list) naming one manifest per platform, a manifest naming a config and
//! layers, and the config (how the image runs: Env, WorkingDir, User,
//! Entrypoint, Cmd). OCI and Docker spellings are both read.

use serde::{Deserialize, Serialize};

use crate::digest::Digest;

/// Largest manifest, index or config read (real ones are a few KiB).
pub const MAX_DOCUMENT: u64 = 4 << 20;
/// Most layers an image may have (Docker caps at 127).
pub const MAX_LAYERS: usize = 128;

/// An OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// An OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// A Docker manifest list.
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// A Docker image manifest (schema 2).
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// What a manifest request accepts, in that order.
pub const ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";

/// How a layer's tar is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Compression {
    /// A plain tar.
    None,
    /// gzip.
    Gzip,
    /// zstd.
    Zstd,
}

impl Compression {
    /// The compression a layer media type says, or `None` for a type that is
    /// not a layer moat can apply (a foreign layer, an artifact).
    pub fn of_media_type(media_type: &str) -> Option<Self> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar" => Some(Self::None),
            "application/vnd.oci.image.layer.v1.tar+gzip" | "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
                Some(Self::Gzip)
            }
            "application/vnd.oci.image.layer.v1.tar+zstd" | "application/vnd.docker.image.rootfs.diff.tar.zstd" => {
                Some(Self::Zstd)
            }
            _ => None,
        }
    }
}

/// A reference to a blob or a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Its media type.
    pub media_type: String,
    /// Its digest.
    pub digest: Digest,
    /// Its size in bytes.
    pub size: u64,
    /// The platform, in an index.
    #[serde(default)]
    pub platform: Option<Platform>,
}

/// A platform in an index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Platform {
    /// `amd64`, `arm64`, ...
    pub architecture: String,
    /// `linux`, `windows`, ...
    pub os: String,
    /// `v8`, ...
    #[serde(default)]
    pub variant: Option<String>,
}

/// An index or a manifest: which one its media type says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Document {
    /// 2.
    pub schema_version: u32,
    /// Its media type (optional in OCI: then told by its fields).
    #[serde(default)]
    pub media_type: Option<String>,
    /// An index's manifests.
    #[serde(default)]
    pub manifests: Option<Vec<Descriptor>>,
    /// A manifest's config.
    #[serde(default)]
    pub config: Option<Descriptor>,
    /// A manifest's layers, bottom first.
    #[serde(default)]
    pub layers: Option<Vec<Descriptor>>,
}

/// A manifest: what an image is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Its config blob.
    pub config: Descriptor,
    /// Its layers, bottom first, each a layer moat can apply.
    pub layers: Vec<(Descriptor, Compression)>,
}

/// Why a document cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Not JSON of the expected shape.
    #[error("the registry's {what} is malformed: {why}")]
    Malformed {
        /// Which document.
        what: &'static str,
        /// The parser's words.
        why: String,
    },
    /// A media type moat does not read.
    #[error("media type {0:?} is not an image manifest or index moat reads (OCI or Docker schema 2)")]
    MediaType(String),
    /// The index has no linux/amd64 image.
    #[error("the index has no linux/amd64 image (it has: {0})")]
    NoPlatform(String),
    /// A layer moat cannot apply.
    #[error("layer {digest} has media type {media_type:?}, which moat cannot apply")]
    LayerType {
        /// The layer.
        digest: Digest,
        /// Its type.
        media_type: String,
    },
    /// More layers than any real image has.
    #[error("the manifest has {0} layers (at most {MAX_LAYERS})")]
    TooManyLayers(usize),
}

/// What a manifest request returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// An index: the manifest to fetch next.
    Index(Descriptor),
    /// A manifest.
    Manifest(Manifest),
}

fn malformed(what: &'static str) -> impl Fn(serde_json::Error) -> ManifestError {
    move |e| ManifestError::Malformed { what, why: e.to_string() }
}

/// Reads a manifest or an index (`content_type` is the response's header,
/// used when the document does not say its own type); an index resolves to
/// its linux/amd64 entry.
pub fn read(bytes: &[u8], content_type: Option<&str>) -> Result<Fetched, ManifestError> {
    let doc: Document = serde_json::from_slice(bytes).map_err(malformed("manifest"))?;
    let media_type =
        doc.media_type.clone().or_else(|| content_type.map(|c| c.split(';').next().unwrap_or(c).trim().to_string()));
    let is_index = match media_type.as_deref() {
        Some(OCI_INDEX | DOCKER_LIST) => true,
        Some(OCI_MANIFEST | DOCKER_MANIFEST) => false,
        // OCI lets the type be left out: the fields tell.
        _ if doc.manifests.is_some() => true,
        _ if doc.config.is_some() => false,
        other => return Err(ManifestError::MediaType(other.unwrap_or("none").to_string())),
    };
    if is_index {
        let manifests = doc.manifests.unwrap_or_default();
        let amd64 = manifests.iter().find(|d| {
            d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
                && matches!(d.media_type.as_str(), OCI_MANIFEST | DOCKER_MANIFEST)
        });
        return match amd64 {
            Some(d) => Ok(Fetched::Index(d.clone())),
            None => {
                let have: Vec<String> = manifests
                    .iter()
                    .filter_map(|d| d.platform.as_ref())
                    .take(16)
                    .map(|p| format!("{}/{}", p.os, p.architecture))
                    .collect();
                Err(ManifestError::NoPlatform(if have.is_empty() { "none".into() } else { have.join(", ") }))
            }
        };
    }
    let config = doc.config.ok_or(ManifestError::Malformed { what: "manifest", why: "no config".into() })?;
    let layers = doc.layers.unwrap_or_default();
    if layers.len() > MAX_LAYERS {
        return Err(ManifestError::TooManyLayers(layers.len()));
    }
    let layers = layers
        .into_iter()
        .map(|d| match Compression::of_media_type(&d.media_type) {
            Some(c) => Ok((d, c)),
            None => Err(ManifestError::LayerType { digest: d.digest.clone(), media_type: d.media_type.clone() }),
        })
        .collect::<Result<_, _>>()?;
    Ok(Fetched::Manifest(Manifest { config, layers }))
}

/// An image's config: how it runs, and its layers' uncompressed digests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `linux`.
    #[serde(default)]
    pub os: String,
    /// `amd64`.
    #[serde(default)]
    pub architecture: String,
    /// How a container of it runs.
    #[serde(default)]
    pub config: RunConfig,
    /// Its layers' diff ids.
    #[serde(default)]
    pub rootfs: RootFs,
}

/// The part of an image config that says how it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    /// `NAME=VALUE` pairs.
    #[serde(default)]
    pub env: Option<Vec<String>>,
    /// The directory commands start in.
    #[serde(default)]
    pub working_dir: Option<String>,
    /// `USER[:GROUP]`, names or numbers.
    #[serde(default)]
    pub user: Option<String>,
    /// The program run.
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    /// Its default arguments.
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
}

/// The layers' uncompressed digests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootFs {
    /// `layers`.
    #[serde(default, rename = "type")]
    pub kind: String,
    /// One per layer, bottom first.
    #[serde(default)]
    pub diff_ids: Vec<Digest>,
}

/// Reads an image config.
pub fn read_config(bytes: &[u8]) -> Result<ImageConfig, ManifestError> {
    serde_json::from_slice(bytes).map_err(malformed("image config"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    const D: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn an_index_resolves_to_linux_amd64() {
        let index = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[
            {{"mediaType":"{OCI_MANIFEST}","digest":"{D}","size":1,"platform":{{"architecture":"arm64","os":"linux"}}}},
            {{"mediaType":"{DOCKER_MANIFEST}","digest":"{D}","size":2,"platform":{{"architecture":"amd64","os":"linux"}}}}]}}"#
        );
        match read(index.as_bytes(), None).unwrap() {
            Fetched::Index(d) => assert_eq!(d.size, 2),
            other => panic!("{other:?}"),
        }
        let arm_only = index.replace("amd64", "riscv64");
        let err = read(arm_only.as_bytes(), None).unwrap_err().to_string();
        assert!(err.contains("linux/arm64, linux/riscv64"), "{err}");
    }

    #[test]
    fn manifests_of_both_kinds_are_read() {
        let manifest = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{D}","size":3}},
            "layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+zstd","digest":"{D}","size":4}},
                      {{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","digest":"{D}","size":5}}]}}"#
        );
        let Fetched::Manifest(m) = read(manifest.as_bytes(), Some(OCI_MANIFEST)).unwrap() else { panic!() };
        assert_eq!(m.layers.iter().map(|(_, c)| *c).collect::<Vec<_>>(), [Compression::Zstd, Compression::Gzip]);
        let foreign = manifest.replace(
            "application/vnd.oci.image.layer.v1.tar+zstd",
            "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
        );
        assert!(matches!(read(foreign.as_bytes(), None), Err(ManifestError::LayerType { .. })));
        assert!(read(b"{}", Some("text/html")).is_err());
        assert!(read(b"\xff\xfe", None).is_err());
    }

    #[test]
    fn configs_say_how_the_image_runs() {
        let c = read_config(
            format!(r#"{{"os":"linux","architecture":"amd64","config":{{"Env":["A=1"],"WorkingDir":"/srv","User":"app"}},"rootfs":{{"type":"layers","diff_ids":["{D}"]}}}}"#)
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(c.config.user.as_deref(), Some("app"));
        assert_eq!(c.rootfs.diff_ids.len(), 1);
    }
}
