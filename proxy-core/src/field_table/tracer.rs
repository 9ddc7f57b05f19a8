//! A serde `Deserializer` that feeds a type one sample of every field it names, recording each
//! field's path (`clusters[].health_checks[].interval`), so a test can list what a type accepts.
//!
//! Every struct is asked for all of its fields; a sequence gets one element (`[]`), a map one
//! entry (`.*`), an option `Some`, an enum its first variant, a scalar zero or `""`. A value its
//! type refuses (an address parsed from `""`) fails the pass: the failing path is left out of the
//! next pass (the type's default applies), and when it is a required field its struct is left
//! out instead. The field names of every struct reached are recorded before its values are
//! tried, so a path left out loses only what lies below it.
//!
//! Each path's [`Kind`] (what its type asked the deserializer for) is recorded too, and whether
//! it is optional: the configuration reference and its JSON Schema are built from them
//! (`reference`).

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet},
    fmt,
    rc::Rc,
};

use serde::de::{
    self, DeserializeOwned, DeserializeSeed, EnumAccess, IntoDeserializer, MapAccess, SeqAccess,
    VariantAccess, Visitor,
};

/// Passes one type may take before the tracer gives up (each pass leaves out one more path).
const MAX_PASSES: usize = 200;

/// What a path's type asked the deserializer for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Bool,
    /// An integer type, with its bounds.
    Int {
        min: i128,
        max: i128,
    },
    Float,
    Str,
    Seq,
    Map,
    /// A struct, with its fields in declaration order.
    Struct(&'static [&'static str]),
    /// An enum whose first variant is a unit variant, written as one of these names.
    Enum(&'static [&'static str]),
    /// Whatever the value is (`deserialize_any`, an enum with data): the type decides.
    Any,
}

/// What tracing one or more types found.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Field paths.
    pub fields: BTreeSet<String>,
    /// The kind of each path reached (fields, `[]` elements, `.*` map values).
    pub kinds: BTreeMap<String, Kind>,
    /// Paths whose type is an `Option`.
    pub optional: BTreeSet<String>,
}

impl Trace {
    /// Adds `other`'s paths; a specific kind replaces [`Kind::Any`], never the reverse (a
    /// `typed_config` is `Any` in its cluster and a struct in its own trace).
    pub fn extend(&mut self, other: Trace) {
        self.fields.extend(other.fields);
        self.optional.extend(other.optional);
        for (path, kind) in other.kinds {
            record(&mut self.kinds, path, kind);
        }
    }
}

/// Records `kind` at `path` unless it is [`Kind::Any`] and the path has a kind already.
fn record(kinds: &mut BTreeMap<String, Kind>, path: String, kind: Kind) {
    if kind != Kind::Any || !kinds.contains_key(&path) {
        kinds.insert(path, kind);
    }
}

/// What the passes share.
#[derive(Default)]
struct State {
    /// Field paths seen so far.
    fields: BTreeSet<String>,
    /// Kinds and optional paths seen so far.
    kinds: BTreeMap<String, Kind>,
    optional: BTreeSet<String>,
    /// Paths no pass feeds any more.
    skip: BTreeSet<String>,
    /// The path of the value asked for last.
    last: String,
    /// Structs being filled, outermost first: (type name, path).
    structs: Vec<(&'static str, String)>,
}

type Shared = Rc<RefCell<State>>;

/// Why a pass stopped.
#[derive(Debug)]
pub struct TraceError {
    message: String,
    /// A required field was left out: its struct must be left out instead.
    missing: bool,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for TraceError {}

impl de::Error for TraceError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self {
            message: msg.to_string(),
            missing: false,
        }
    }

    fn missing_field(field: &'static str) -> Self {
        Self {
            message: format!("missing field {field}"),
            missing: true,
        }
    }
}

/// Every field path `T` accepts, each prefixed with `root` (`""` for none).
pub fn field_paths<T: DeserializeOwned>(root: &str) -> BTreeSet<String> {
    trace::<T>(root).fields
}

/// Every path `T` accepts with its kind, each prefixed with `root` (`""` for none).
pub fn trace<T: DeserializeOwned>(root: &str) -> Trace {
    let state = Shared::default();
    for _ in 0..MAX_PASSES {
        state.borrow_mut().structs.clear();
        let tracer = Tracer {
            state: state.clone(),
            path: root.to_owned(),
        };
        let Err(err) = T::deserialize(tracer) else {
            let s = state.take();
            return Trace {
                fields: s.fields,
                kinds: s.kinds,
                optional: s.optional,
            };
        };
        let mut s = state.borrow_mut();
        let culprit = if err.missing {
            s.structs.last().map(|(_, p)| p.clone()).unwrap_or_default()
        } else {
            s.last.clone()
        };
        assert!(
            culprit != root && s.skip.insert(culprit.clone()),
            "tracing {root:?}: {err} at {culprit:?}, which cannot be left out"
        );
    }
    panic!("tracing {root:?} took more than {MAX_PASSES} passes")
}

/// The deserializer handed to every value, at its path.
struct Tracer {
    state: Shared,
    path: String,
}

impl Tracer {
    fn at(&self, path: String) -> Self {
        self.state.borrow_mut().last.clone_from(&path);
        Self {
            state: self.state.clone(),
            path,
        }
    }

    fn touch(&self) {
        self.state.borrow_mut().last.clone_from(&self.path);
    }

    /// The deserializer of this same path, recording nothing.
    fn twin(&self) -> Self {
        Self {
            state: self.state.clone(),
            path: self.path.clone(),
        }
    }

    /// Records this path's kind.
    fn kind(&self, kind: Kind) {
        record(&mut self.state.borrow_mut().kinds, self.path.clone(), kind);
    }

    /// Records this path's kind, replacing what the value inside recorded there.
    fn kind_over(&self, kind: Kind) {
        self.state
            .borrow_mut()
            .kinds
            .insert(self.path.clone(), kind);
    }
}

/// The kind of the integer type `T`.
fn int<T: Into<i128> + Copy>(min: T, max: T) -> Kind {
    Kind::Int {
        min: min.into(),
        max: max.into(),
    }
}

macro_rules! scalars {
    ($($method:ident => $visit:ident($($value:expr)?) as $kind:expr),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
            self.touch();
            self.kind($kind);
            visitor.$visit($($value)?)
        })*
    };
}

impl<'de> de::Deserializer<'de> for Tracer {
    type Error = TraceError;

    scalars! {
        deserialize_any => visit_unit() as Kind::Any,
        deserialize_bool => visit_bool(false) as Kind::Bool,
        deserialize_i8 => visit_i8(0) as int(i8::MIN, i8::MAX),
        deserialize_i16 => visit_i16(0) as int(i16::MIN, i16::MAX),
        deserialize_i32 => visit_i32(0) as int(i32::MIN, i32::MAX),
        deserialize_i64 => visit_i64(0) as int(i64::MIN, i64::MAX),
        deserialize_u8 => visit_u8(0) as int(u8::MIN, u8::MAX),
        deserialize_u16 => visit_u16(0) as int(u16::MIN, u16::MAX),
        deserialize_u32 => visit_u32(0) as int(u32::MIN, u32::MAX),
        deserialize_u64 => visit_u64(0) as int(u64::MIN, u64::MAX),
        deserialize_f32 => visit_f32(0.0) as Kind::Float,
        deserialize_f64 => visit_f64(0.0) as Kind::Float,
        deserialize_char => visit_char('a') as Kind::Str,
        deserialize_str => visit_str("") as Kind::Str,
        deserialize_string => visit_string(String::new()) as Kind::Str,
        deserialize_bytes => visit_bytes(&[]) as Kind::Any,
        deserialize_byte_buf => visit_byte_buf(Vec::new()) as Kind::Any,
        deserialize_unit => visit_unit() as Kind::Any,
        deserialize_ignored_any => visit_unit() as Kind::Any,
        deserialize_identifier => visit_str("") as Kind::Str,
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
        self.touch();
        self.state.borrow_mut().optional.insert(self.path.clone());
        visitor.visit_some(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        self.touch();
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
        self.touch();
        self.kind(Kind::Seq);
        let element = format!("{}[]", self.path);
        let done = self.at(self.path.clone());
        // An element its type refuses is left out by an empty sequence.
        let left = usize::from(!self.state.borrow().skip.contains(&element));
        let value = visitor.visit_seq(Elements {
            tracer: self,
            path: element,
            left,
        })?;
        done.touch();
        Ok(value)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        self.touch();
        self.kind(Kind::Seq);
        let element = format!("{}[]", self.path);
        visitor.visit_seq(Elements {
            tracer: self,
            path: element,
            left: len,
        })
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        self.deserialize_tuple(len, visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, TraceError> {
        self.touch();
        self.kind(Kind::Map);
        let entry = join(&self.path, "*");
        let mut keys = vec![("k", entry)];
        // An entry its type refuses is left out by an empty map.
        keys.retain(|(_, path)| !self.state.borrow().skip.contains(path));
        visitor.visit_map(Fields { tracer: self, keys })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        self.touch();
        self.kind(Kind::Struct(fields));
        let keys = self.enter(name, fields)?;
        let value = visitor.visit_map(Fields {
            tracer: self.at(self.path.clone()),
            keys,
        })?;
        self.state.borrow_mut().structs.pop();
        // A conversion after the struct (`try_from`) that fails points at the struct.
        self.touch();
        Ok(value)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        self.touch();
        self.kind(Kind::Enum(variants));
        let variant = variants.first().copied().unwrap_or_default();
        visitor.visit_enum(Variant {
            tracer: self,
            variant,
        })
    }
}

impl Tracer {
    /// Records `fields` under this path and returns the ones this pass feeds, with their paths.
    fn enter(
        &self,
        name: &'static str,
        fields: &'static [&'static str],
    ) -> Result<Vec<(&'static str, String)>, TraceError> {
        let mut s = self.state.borrow_mut();
        if s.structs.iter().any(|(n, _)| *n == name) {
            return Err(de::Error::custom(format!("{name} contains itself")));
        }
        s.structs.push((name, self.path.clone()));
        let mut keys = Vec::with_capacity(fields.len());
        for field in fields {
            let path = join(&self.path, field);
            s.fields.insert(path.clone());
            if !s.skip.contains(&path) {
                keys.push((*field, path));
            }
        }
        Ok(keys)
    }
}

fn join(parent: &str, field: &str) -> String {
    if parent.is_empty() {
        field.to_owned()
    } else {
        format!("{parent}.{field}")
    }
}

/// A struct's fields (or a map's one entry), each with its value's path.
struct Fields {
    tracer: Tracer,
    keys: Vec<(&'static str, String)>,
}

impl<'de> MapAccess<'de> for Fields {
    type Error = TraceError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, TraceError> {
        let Some((key, _)) = self.keys.first() else {
            return Ok(None);
        };
        seed.deserialize(key.into_deserializer()).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, TraceError> {
        let (_, path) = self.keys.remove(0);
        seed.deserialize(self.tracer.at(path))
    }
}

/// A sequence's elements, all at one path.
struct Elements {
    tracer: Tracer,
    path: String,
    left: usize,
}

impl<'de> SeqAccess<'de> for Elements {
    type Error = TraceError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, TraceError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(self.tracer.at(self.path.clone()))
            .map(Some)
    }
}

/// An enum's first variant.
struct Variant {
    tracer: Tracer,
    variant: &'static str,
}

impl<'de> EnumAccess<'de> for Variant {
    type Error = TraceError;
    type Variant = Self;

    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Self), TraceError> {
        let value = seed.deserialize(self.variant.into_deserializer())?;
        Ok((value, self))
    }
}

impl<'de> VariantAccess<'de> for Variant {
    type Error = TraceError;

    fn unit_variant(self) -> Result<(), TraceError> {
        Ok(())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<T::Value, TraceError> {
        let at = self.tracer.twin();
        let value = seed.deserialize(self.tracer);
        at.kind_over(Kind::Any);
        value
    }

    fn tuple_variant<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        let at = self.tracer.twin();
        let value = de::Deserializer::deserialize_tuple(self.tracer, len, visitor);
        at.kind_over(Kind::Any);
        value
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, TraceError> {
        let at = self.tracer.twin();
        let value =
            de::Deserializer::deserialize_struct(self.tracer, self.variant, fields, visitor);
        at.kind_over(Kind::Any);
        value
    }
}
