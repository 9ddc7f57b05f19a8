//! Decoding one `/v1/config/<kind>` answer: each element on its own, so that one entry this
//! daemon cannot use is skipped (and said why) while the others apply.

use std::collections::BTreeMap;

use proxy_chain::{ConfigEntry, EntryKind};
use serde_json::Value;

/// Most entries of one kind an answer may hold; a longer list is refused whole (the last
/// entries stay). Consul sets no limit; this keeps one answer from growing every chain
/// compilation without bound.
pub const MAX_ENTRIES_PER_KIND: usize = 10_000;

/// Longest entry name taken (Consul's service names are DNS labels; 256 leaves room).
const MAX_NAME: usize = 256;

/// Fields of Consul's API answer that are not the entry's content: they change on every write
/// even when the content does not, so they are dropped before decoding.
const RAFT_FIELDS: [&str; 3] = ["CreateIndex", "ModifyIndex", "Hash"];

/// An entry of an answer that was left out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedEntry {
    /// The kind queried.
    pub kind: EntryKind,
    /// The entry's `Name` (`#<n>`, its position, for an element without a usable name).
    pub name: String,
    /// Why it was left out.
    pub reason: String,
}

/// The usable entries of one answer by name, and those left out.
pub type Decoded = (BTreeMap<String, ConfigEntry>, Vec<SkippedEntry>);

/// Decodes `body`, the answer to `/v1/config/<kind>`. An error only when the body is not a
/// JSON array (or `null`, Consul's empty list) or is longer than [`MAX_ENTRIES_PER_KIND`].
pub fn decode(kind: EntryKind, body: &[u8]) -> Result<Decoded, String> {
    let list: Option<Vec<Value>> = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not a JSON list of entries ({e})"))?;
    let list = list.unwrap_or_default();
    if list.len() > MAX_ENTRIES_PER_KIND {
        return Err(format!(
            "{} entries, more than the {MAX_ENTRIES_PER_KIND} this daemon takes of one kind",
            list.len()
        ));
    }
    let mut entries = BTreeMap::new();
    let mut skipped = Vec::new();
    for (n, value) in list.into_iter().enumerate() {
        let name = entry_name(&value).unwrap_or_else(|| format!("#{n}"));
        match decode_one(kind, value) {
            Ok(entry) if entries.contains_key(entry.name()) => skipped.push(SkippedEntry {
                kind,
                name,
                reason: "a second entry of this kind and name in one answer".to_owned(),
            }),
            Ok(entry) => drop(entries.insert(entry.name().to_owned(), entry)),
            Err(reason) => skipped.push(SkippedEntry { kind, name, reason }),
        }
    }
    Ok((entries, skipped))
}

/// The `Name` of an element, when it is a short string.
fn entry_name(value: &Value) -> Option<String> {
    let name = value.get("Name")?.as_str()?;
    (!name.is_empty() && name.len() <= MAX_NAME).then(|| name.to_owned())
}

/// One element: an object of the queried kind, decoded and normalized. It is not validated
/// here: an entry that breaks a rule of this daemon's is published as Consul holds it, and
/// composition ([`compile_each`](crate::chain::compile_each)) leaves out the chains that read
/// it, each with the reason.
fn decode_one(kind: EntryKind, mut value: Value) -> Result<ConfigEntry, String> {
    let Some(object) = value.as_object_mut() else {
        return Err("not a JSON object".to_owned());
    };
    match object.get("Kind").and_then(Value::as_str) {
        Some(k) if k == kind.as_str() => {}
        Some(_) => return Err(format!("its Kind is not {}", kind.as_str())),
        None => return Err("it has no Kind".to_owned()),
    }
    if entry_name(&value).is_none() {
        return Err(format!(
            "its Name is missing, empty or longer than {MAX_NAME} bytes"
        ));
    }
    if let Some(object) = value.as_object_mut() {
        for field in RAFT_FIELDS {
            object.remove(field);
        }
    }
    let mut entry: ConfigEntry =
        serde_json::from_value(value).map_err(|e| format!("not a usable entry: {e}"))?;
    entry.normalize();
    Ok(entry)
}
