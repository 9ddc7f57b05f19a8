//! What one compilation looked up: every entry it asked for by kind and name, found or not.
//!
//! The compiler reads entries only through [`Reader`], and its result depends on nothing else
//! but the request. So a chain compiled from one set of entries compiles to the same result
//! from another set that holds the same value (or the same absence) for every entry the first
//! compilation read ([`EntryReads::same_in`]): a caller may keep that result instead of
//! compiling again.

use std::{cell::RefCell, collections::BTreeSet};

use crate::entries::{
    Entries, EntryKind, EntryRef, ProxyDefaults, ServiceDefaults, ServiceResolver, ServiceRouter,
    ServiceSplitter,
};

/// The entries a compilation read, by kind and name (proxy-defaults under an empty name: there
/// is one, whatever its name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntryReads(BTreeSet<(EntryKind, String)>);

impl EntryReads {
    /// Whether `before` and `after` hold the same value, or the same absence, for every entry
    /// read: then a compilation that read these from `before` gives the same result from
    /// `after`.
    pub fn same_in(&self, before: &Entries, after: &Entries) -> bool {
        self.0
            .iter()
            .all(|(kind, name)| read(before, *kind, name) == read(after, *kind, name))
    }

    /// Whether the compilation read the entry of `kind` named `name` (for proxy-defaults, any).
    pub fn contains(&self, kind: EntryKind, name: &str) -> bool {
        let name = if kind == EntryKind::ProxyDefaults {
            ""
        } else {
            name
        };
        self.0.contains(&(kind, name.to_owned()))
    }

    /// How many entries were read.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when nothing was read.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The entry of `kind` and `name` in `entries`; proxy-defaults whatever its name.
fn read<'a>(entries: &'a Entries, kind: EntryKind, name: &str) -> Option<EntryRef<'a>> {
    match kind {
        EntryKind::ProxyDefaults => entries.proxy_defaults().map(EntryRef::ProxyDefaults),
        kind => entries.get(kind, name),
    }
}

/// The compiler's view of the entries: each lookup is recorded.
#[derive(Clone, Copy)]
pub(super) struct Reader<'a> {
    entries: &'a Entries,
    reads: &'a RefCell<EntryReads>,
}

impl<'a> Reader<'a> {
    pub(super) fn new(entries: &'a Entries, reads: &'a RefCell<EntryReads>) -> Self {
        Reader { entries, reads }
    }

    fn note(&self, kind: EntryKind, name: &str) {
        self.reads.borrow_mut().0.insert((kind, name.to_owned()));
    }

    /// The service-router named `name`.
    pub(super) fn router(&self, name: &str) -> Option<&'a ServiceRouter> {
        self.note(EntryKind::ServiceRouter, name);
        self.entries.router(name)
    }

    /// The service-splitter named `name`.
    pub(super) fn splitter(&self, name: &str) -> Option<&'a ServiceSplitter> {
        self.note(EntryKind::ServiceSplitter, name);
        self.entries.splitter(name)
    }

    /// The service-resolver named `name`.
    pub(super) fn resolver(&self, name: &str) -> Option<&'a ServiceResolver> {
        self.note(EntryKind::ServiceResolver, name);
        self.entries.resolver(name)
    }

    /// The service-defaults named `name`.
    pub(super) fn service_defaults(&self, name: &str) -> Option<&'a ServiceDefaults> {
        self.note(EntryKind::ServiceDefaults, name);
        self.entries.service_defaults(name)
    }

    /// The global proxy-defaults.
    pub(super) fn proxy_defaults(&self) -> Option<&'a ProxyDefaults> {
        self.note(EntryKind::ProxyDefaults, "");
        self.entries.proxy_defaults()
    }
}
