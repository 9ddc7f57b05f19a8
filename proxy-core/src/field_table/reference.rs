//! The configuration reference, built from two sources that the other tests of `field_table`
//! already hold true: what the file's types accept ([`super::tracer`]: every path, its kind,
//! whether it is optional; defaults from a minimal file parsed and serialized back) and the
//! table of docs/fields.md (what each field does). It is written twice: docs/config.schema.json,
//! a JSON Schema (draft 2020-12) for editors, and docs/config-reference.md.
//!
//! The test [`the_committed_reference_is_what_the_code_generates`] fails when either committed
//! file differs; with `PROXY_WRITE_DOCS=1` (what `cargo xtask docs` sets) it writes them instead.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use serde_json::{Map, Value, json};

use super::{
    FIELDS, file_trace, lines, quoted,
    tracer::{Kind, Trace},
};
use crate::config::Config;

/// The generated files, relative to the workspace root.
const SCHEMA_FILE: &str = "docs/config.schema.json";
const REFERENCE_FILE: &str = "docs/config-reference.md";

/// Set to write the files rather than compare them.
const WRITE_ENV: &str = "PROXY_WRITE_DOCS";

/// A minimal cluster and service, parsed to learn their fields' defaults, and the paths this
/// text sets itself (so not defaults), each with everything below it.
const MINIMAL: &str = "clusters:
  - name: a
    load_assignment:
      endpoints:
        - lb_endpoints:
            - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 1 } } }
services:
  - { name: a, address: 127.77.0.1, port: 80, cluster: a }
";
const GIVEN: &[&str] = &[
    "clusters[].name",
    "clusters[].load_assignment",
    "services[].name",
    "services[].address",
    "services[].port",
    "services[].cluster",
];

/// What the reference is made of.
struct Reference {
    trace: Trace,
    /// The `file` rows of docs/fields.md: the fields each names and its description.
    rows: Vec<(Vec<String>, String)>,
    defaults: BTreeMap<String, Value>,
}

impl Reference {
    fn new() -> Self {
        let trace = file_trace();
        let defaults = defaults(&trace);
        Self {
            trace,
            rows: file_rows(),
            defaults,
        }
    }

    /// The description of the row naming `path`, else of the narrowest group (`a.*`) over it.
    fn description(&self, path: &str) -> Option<&str> {
        let exact = self
            .rows
            .iter()
            .find(|(names, _)| names.iter().any(|n| n == path));
        let group = || {
            self.rows
                .iter()
                .filter_map(|(names, text)| {
                    let len = names
                        .iter()
                        .filter_map(|n| n.strip_suffix(".*"))
                        .filter(|g| path == *g || below(path, g))
                        .map(str::len)
                        .max()?;
                    Some((len, text))
                })
                .max_by_key(|(len, _)| *len)
                .map(|(_, text)| text)
        };
        exact
            .map(|(_, text)| text)
            .or_else(group)
            .map(String::as_str)
    }

    /// The JSON Schema of the value at `path`.
    fn schema(&self, path: &str) -> Value {
        let mut node = match self.trace.kinds.get(path) {
            Some(Kind::Struct(fields)) => {
                let properties: Map<String, Value> = fields
                    .iter()
                    .map(|f| ((*f).to_owned(), self.schema(&join(path, f))))
                    .collect();
                let mut node = json!({
                    "type": "object",
                    "properties": properties,
                    "additionalProperties": false,
                });
                let forms = self.forms(path);
                if !forms.is_empty() {
                    node["allOf"] = Value::Array(forms);
                }
                node
            }
            Some(Kind::Seq) => json!({"type": "array", "items": self.schema(&format!("{path}[]"))}),
            Some(Kind::Map) => {
                json!({"type": "object", "additionalProperties": self.schema(&join(path, "*"))})
            }
            Some(Kind::Enum(names)) => json!({ "enum": names }),
            Some(Kind::Bool) => json!({"type": "boolean"}),
            Some(Kind::Float) => json!({"type": "number"}),
            Some(Kind::Str) => json!({"type": "string"}),
            Some(Kind::Int { min, max }) => {
                let mut node = json!({"type": "integer"});
                if let Some((min, max)) = bounds(*min, *max) {
                    node["minimum"] = json!(min);
                    if let Some(max) = max {
                        node["maximum"] = json!(max);
                    }
                }
                node
            }
            Some(Kind::Any) | None => json!({}),
        };
        if self.trace.optional.contains(path) {
            allow_null(&mut node);
        }
        if let Some(text) = self.description(path) {
            node["description"] = json!(text);
        }
        if let Some(value) = self.defaults.get(path) {
            node["default"] = value.clone();
        }
        node
    }

    /// The forms of the object at `path` chosen by its `name` (`cluster_type(NAME)`): one
    /// `if name is NAME then these fields` each.
    fn forms(&self, path: &str) -> Vec<Value> {
        let prefix = format!("{path}(");
        let mut names: Vec<&str> = self
            .trace
            .kinds
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix)?.split_once(')').map(|(n, _)| n))
            .collect();
        names.dedup();
        names
            .into_iter()
            .map(|name| {
                let at = format!("{path}({name})");
                let fields: Map<String, Value> = self
                    .trace
                    .kinds
                    .keys()
                    .filter_map(|k| k.strip_prefix(&at)?.strip_prefix('.'))
                    .filter(|rest| !rest.contains(['.', '[', '(']))
                    .map(|field| (field.to_owned(), self.schema(&join(&at, field))))
                    .collect();
                json!({
                    "if": {"properties": {"name": {"const": name}}, "required": ["name"]},
                    "then": {"properties": fields},
                })
            })
            .collect()
    }

    fn schema_text(&self) -> String {
        let mut root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "proxy configuration file",
            "description": "Generated by `cargo xtask docs` from the types the daemon parses its configuration with; docs/config-reference.md lists the same fields.",
        });
        let body = self.schema("");
        for (key, value) in body.as_object().expect("the file is an object") {
            root[key] = value.clone();
        }
        serde_json::to_string_pretty(&root).expect("a schema serializes") + "\n"
    }

    /// A line of text for the type at `path`.
    fn type_text(&self, path: &str) -> String {
        match self.trace.kinds.get(path) {
            Some(Kind::Bool) => "boolean".to_owned(),
            Some(Kind::Int { min, max }) => match bounds(*min, *max) {
                Some((min, Some(max))) => format!("integer, {min} to {max}"),
                Some((min, None)) => format!("integer, at least {min}"),
                None => "integer".to_owned(),
            },
            Some(Kind::Float) => "number".to_owned(),
            Some(Kind::Str) => "string".to_owned(),
            Some(Kind::Seq) => format!("list of {}", self.type_text(&format!("{path}[]"))),
            Some(Kind::Map) => format!("map of {}", self.type_text(&join(path, "*"))),
            Some(Kind::Struct(_)) => "object".to_owned(),
            Some(Kind::Enum(names)) => {
                let names: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
                format!("one of {}", names.join(", "))
            }
            Some(Kind::Any) | None => "any (see its description)".to_owned(),
        }
    }

    fn markdown(&self) -> String {
        let mut md = String::from(HEADER);
        md.push_str("| field | type | default |\n|---|---|---|\n");
        for path in &self.trace.fields {
            let default = match self.defaults.get(path) {
                Some(Value::String(s)) => format!("`{s}`"),
                Some(value) => format!("`{value}`"),
                None => String::new(),
            };
            let _ = writeln!(
                md,
                "| `{path}` | {} | {} |",
                self.type_text(path).replace('|', "\\|"),
                default.replace('|', "\\|"),
            );
        }
        md
    }
}

const HEADER: &str = "# Configuration reference

<!-- Generated by `cargo xtask docs` from the configuration's types: do not edit. -->

Every field of the configuration file with its type and its default, generated by `cargo xtask
docs` from the types the daemon parses the file with (`proxy-core/src/config`). A unit test
(`field_table::reference`) fails when this page or [config.schema.json](config.schema.json), the
same as a JSON Schema for editors, differs from what the code generates. What each field does on
the kernel path and on the proxy path, and what refuses it: [fields.md](fields.md) (the schema
carries that text as each field's description); how the parts fit:
[configuration.md](configuration.md).

`a[]` is an element of the list `a`, `a.*` a value of the map `a`, and `a(NAME)` the form of `a`
whose `name` is `NAME` (a `typed_config`). A default is what an omitted field takes in a minimal
file; a field without one is optional or required as its description says. Unknown fields are
errors.

";

/// The `file` rows of docs/fields.md: the fields each names, and its description.
fn file_rows() -> Vec<(Vec<String>, String)> {
    lines(FIELDS)
        .filter_map(|line| {
            let cells: Vec<&str> = line.split(" | ").collect();
            if cells.first()?.trim_start_matches('|').trim() != "file" {
                return None;
            }
            let (kernel, proxy) = (plain(cells.get(2)?), plain(cells.get(3)?));
            let text = if proxy == "the same" {
                kernel
            } else {
                let kernel = kernel.trim_end_matches('.');
                format!("Kernel path: {kernel}. Proxy path: {proxy}")
            };
            Some((quoted(cells[1]), text))
        })
        .collect()
}

/// `cell` without its markdown links (`[text](target)` becomes `text`).
fn plain(cell: &str) -> String {
    let mut out = String::new();
    let mut rest = cell.trim();
    while let Some(open) = rest.find('[') {
        let link = rest[open..].find("](").and_then(|mid| {
            let close = rest[open + mid..].find(')')?;
            Some((open + mid, open + mid + close))
        });
        let Some((mid, close)) = link else { break };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..mid]);
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The defaults of every traced path: a minimal file and [`MINIMAL`], parsed and serialized
/// back (the effective configuration `/config_dump` shows).
fn defaults(trace: &Trace) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for text in ["clusters: []\n", MINIMAL] {
        let config = Config::parse(text, Path::new("defaults.yaml"))
            .unwrap_or_else(|e| panic!("a minimal file parses: {e}"));
        let value = serde_json::to_value(&config).expect("a configuration serializes");
        walk(&value, "", trace, &mut out);
    }
    out
}

fn walk(value: &Value, path: &str, trace: &Trace, out: &mut BTreeMap<String, Value>) {
    let given = GIVEN.iter().any(|g| path == *g || below(path, g));
    let field = trace.fields.contains(path) && !given;
    match value {
        Value::Null => {}
        Value::Object(map) => {
            for (key, value) in map {
                walk(value, &join(path, key), trace, out);
            }
        }
        Value::Array(items) => {
            if field {
                out.entry(path.to_owned()).or_insert_with(|| value.clone());
            }
            if let Some(first) = items.first() {
                walk(first, &format!("{path}[]"), trace, out);
            }
        }
        _ if field => {
            out.entry(path.to_owned()).or_insert_with(|| value.clone());
        }
        _ => {}
    }
}

/// The bounds worth stating of an integer type: none for a signed 64-bit one, the minimum only
/// for an unsigned 64-bit one.
fn bounds(min: i128, max: i128) -> Option<(i128, Option<i128>)> {
    match (min, max) {
        (min, _) if min == i128::from(i64::MIN) => None,
        (0, max) if max == i128::from(u64::MAX) => Some((0, None)),
        (min, max) => Some((min, Some(max))),
    }
}

/// Lets `node` be null too (an `Option`: null is the same as leaving it out).
fn allow_null(node: &mut Value) {
    if let Some(names) = node.get_mut("enum").and_then(Value::as_array_mut) {
        names.push(Value::Null);
    } else if let Some(kind) = node.get("type").cloned() {
        node["type"] = json!([kind, "null"]);
    }
}

/// Whether `path` lies below `of` (`of.x`, `of[]`, `of(name)`).
fn below(path: &str, of: &str) -> bool {
    path.strip_prefix(of)
        .is_some_and(|rest| rest.starts_with(['.', '[', '(']))
}

fn join(parent: &str, field: &str) -> String {
    if parent.is_empty() {
        field.to_owned()
    } else {
        format!("{parent}.{field}")
    }
}

/// Compares `text` with the committed `file`, or writes it there under [`WRITE_ENV`].
fn check_or_write(file: &str, text: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(file);
    if std::env::var_os(WRITE_ENV).is_some() {
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {file}: {e}"));
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == text,
        "{file} is not what the code generates (the configuration's types or docs/fields.md \
         changed): run `cargo xtask docs` and commit the result"
    );
}

#[test]
fn the_committed_reference_is_what_the_code_generates() {
    let reference = Reference::new();
    check_or_write(SCHEMA_FILE, &reference.schema_text());
    check_or_write(REFERENCE_FILE, &reference.markdown());
}

#[test]
fn the_schema_carries_kinds_defaults_forms_and_descriptions() {
    let reference = Reference::new();
    let schema = reference.schema("");
    let props = &schema["properties"];
    assert_eq!(props["instance"]["type"], "string");
    assert_eq!(props["instance"]["default"], "proxy");
    assert_eq!(props["splice"]["default"], false);
    let cluster = &props["clusters"]["items"];
    assert_eq!(cluster["additionalProperties"], false);
    let policies = cluster["properties"]["lb_policy"]["enum"].to_string();
    assert!(policies.contains("MAGLEV"), "{policies}");
    assert_eq!(cluster["properties"]["lb_policy"]["default"], "RANDOM");
    let forms = cluster["properties"]["cluster_type"]["allOf"].to_string();
    assert!(forms.contains("proxy.clusters.consul"), "{forms}");
    let description = props["kernel_log"]["description"]
        .as_str()
        .unwrap_or_default();
    assert!(description.contains("kernel programs log"), "{description}");
    let md = reference.markdown();
    assert!(
        md.contains("| `services[].hash_key` | one of `netns`,"),
        "{md}"
    );
}
