//! Field groups: serde fields declared once and spliced into every struct that takes them.
//!
//! A cluster's DNS fields are both [`DnsSettings`](super::sources::dns::DnsSettings), what the
//! DNS source runs with, and fields of [`Cluster`](super::Cluster), where the file and CDS put
//! them; its health fields are both `health::ClusterHealthConfig` and fields of `Cluster`.
//! serde's `flatten` would nest one struct in the other, but it collects the fields it does not
//! know into a buffer first, so `deny_unknown_fields` cannot be used with it and a bad value
//! loses its file:line:column. So each group is a macro holding its field list (docs, serde
//! attributes, types), and [`splice!`] appends the lists to a struct written out as usual:
//!
//! ```text
//! splice! {
//!     { #[derive(Deserialize)] #[serde(deny_unknown_fields)] pub struct Cluster { pub name: String, } }
//!     [dns_cluster_fields, dns_file_fields, health_fields]
//! }
//! ```
//!
//! declares `Cluster` with `name` and then every DNS and health field, each with its own doc
//! and serde attributes: one derived `Deserialize`, so unknown fields, error texts and locations
//! are serde's as for any field. The copies between the structs come from the same list
//! (`health_fields!(@copy self, ...)` is a `ClusterHealthConfig` of `self`'s health fields), and
//! so does the list of the fields set (`@changed`); see [`group!`].
//!
//! A group macro is `macro_rules! name { ($($args:tt)*) => { group! { Type [$($args)*] fields } } }`
//! ([`group!`]); serde paths in its attributes (`default = "..."`, `with = "..."`) are
//! written from the crate root, since the fields land in other modules.

/// Appends the field lists of the groups named in `[...]` to the struct in `{...}`, in that
/// order, after its own fields (which must end with a comma). Each group is asked for its list
/// in turn ([`group!`] calls back here with it).
macro_rules! splice {
    // A group left: ask it for its fields; it calls back with them appended.
    ({ $($item:tt)* } [$next:ident $(, $rest:ident)*] $($lists:tt)*) => {
        $next! { { $($item)* } [$($rest),*] $($lists)* }
    };
    // Every list collected: the struct with its own fields, then the groups'.
    (
        {
            $(#[$meta:meta])*
            $vis:vis struct $name:ident { $($own:tt)* }
        }
        []
        $([ $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)? ])*
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $($own)*
            $($( $(#[$field_meta])* pub $field: $ty, )*)*
        }
    };
}

/// The body of a group macro: `group! { Type [args] fields }`. With `args` of
/// `@copy source` (and `, extra: value` pairs for `Type`'s fields outside the group) it is the
/// `Type` literal of `source`'s group fields; `@assign target, source` sets `target`'s group
/// fields to `source`'s; `@changed value, reference` is an array of `(bool, &str)`, each group
/// field's name with whether it differs between the two. Any other `args` are [`splice!`]'s,
/// and the fields are handed back to it.
macro_rules! group {
    (
        $group:path [@copy $source:expr $(, $extra:ident : $value:expr)* $(,)?]
        $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)?
    ) => {
        {
            // A struct literal takes a type's name, not a path fragment: name it here.
            type Group = $group;
            Group {
                $( $field: ::core::clone::Clone::clone(&$source.$field), )*
                $( $extra: $value, )*
            }
        }
    };
    // `@assign target, source`: every group field of `target` set to `source`'s.
    (
        $group:path [@assign $target:expr, $source:expr]
        $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)?
    ) => {
        $( $target.$field = ::core::clone::Clone::clone(&$source.$field); )*
    };
    // `@changed value, reference`: `(differs, field name)` for every group field.
    (
        $group:path [@changed $value:expr, $reference:expr]
        $( $(#[$field_meta:meta])* $field:ident : $ty:ty ),* $(,)?
    ) => {
        [ $( ($value.$field != $reference.$field, stringify!($field)) ),* ]
    };
    ($group:path [$($args:tt)*] $($fields:tt)*) => {
        $crate::config::fields::splice! { $($args)* [$($fields)*] }
    };
}

pub(crate) use group;
pub(crate) use splice;
