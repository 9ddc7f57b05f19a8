//! Maps a field path such as `clusters[1].load_assignment.cluster_name` back to the line and
//! column where it is written, so that errors found after parsing still point into the file.

use yaml_rust2::{
    Event,
    parser::{MarkedEventReceiver, Parser},
    scanner::Marker,
};

/// A position in a config file; both numbers are 1-based.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Position {
    /// Line, 1-based.
    pub line: usize,
    /// Column, 1-based.
    pub column: usize,
}

impl From<Marker> for Position {
    fn from(mark: Marker) -> Self {
        Self {
            line: mark.line(),
            column: mark.col() + 1,
        }
    }
}

/// A YAML node with the position of its first character.
#[derive(Debug)]
enum Node {
    Scalar(Position),
    Seq(Position, Vec<Node>),
    /// Entries are (key, position of the key, value).
    Map(Position, Vec<(String, Position, Node)>),
}

impl Node {
    fn position(&self) -> Position {
        match self {
            Node::Scalar(p) | Node::Seq(p, _) => *p,
            // A block mapping's own mark is not where a reader looks: use its first key.
            Node::Map(p, entries) => entries.first().map_or(*p, |(_, key, _)| *key),
        }
    }
}

/// Positions of every node of a YAML document.
#[derive(Debug)]
pub struct Locator {
    root: Option<Node>,
}

impl Locator {
    /// Indexes `text`. A document that does not parse yields a locator that finds nothing (the
    /// parse error itself carries its position).
    pub fn new(text: &str) -> Self {
        let mut builder = Builder::default();
        let mut parser = Parser::new_from_str(text);
        if parser.load(&mut builder, false).is_err() {
            return Self { root: None };
        }
        Self {
            root: builder.stack.pop().and_then(Frame::into_node),
        }
    }

    /// The position of the deepest node on `path` that exists. For a map entry, the position is
    /// that of its key, which is where a reader looks for the field.
    pub fn find(&self, path: &str) -> Option<Position> {
        let mut node = self.root.as_ref()?;
        let mut found = node.position();
        for segment in segments(path) {
            let next = match (node, segment) {
                (Node::Map(_, entries), Segment::Key(key)) => entries
                    .iter()
                    .find(|(k, _, _)| k == key)
                    .map(|(_, key_pos, value)| (*key_pos, value)),
                (Node::Seq(_, items), Segment::Index(i)) => {
                    items.get(i).map(|item| (item.position(), item))
                }
                _ => None,
            };
            let Some((position, child)) = next else { break };
            found = position;
            node = child;
        }
        Some(found)
    }
}

enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}

/// Splits `a.b[2].c` into `a`, `b`, `2`, `c`.
fn segments(path: &str) -> impl Iterator<Item = Segment<'_>> {
    path.split('.').filter(|s| !s.is_empty()).flat_map(|part| {
        let mut out = Vec::new();
        let (name, rest) = part.split_at(part.find('[').unwrap_or(part.len()));
        if !name.is_empty() {
            out.push(Segment::Key(name));
        }
        for index in rest.split('[').filter_map(|s| s.strip_suffix(']')) {
            if let Ok(i) = index.parse() {
                out.push(Segment::Index(i));
            }
        }
        out
    })
}

/// A node under construction.
enum Frame {
    Seq(Position, Vec<Node>),
    /// The pending key, if a key was read and its value is still to come.
    Map(
        Position,
        Vec<(String, Position, Node)>,
        Option<(String, Position)>,
    ),
    Done(Node),
}

impl Frame {
    fn into_node(self) -> Option<Node> {
        match self {
            Frame::Done(node) => Some(node),
            _ => None,
        }
    }
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
}

impl Builder {
    /// Adds a finished node to the innermost open collection (or leaves it as the document).
    fn push(&mut self, node: Node, key_text: Option<String>) {
        match self.stack.last_mut() {
            Some(Frame::Seq(_, items)) => items.push(node),
            Some(Frame::Map(_, entries, pending)) => match pending.take() {
                Some((key, key_pos)) => entries.push((key, key_pos, node)),
                None => *pending = Some((key_text.unwrap_or_default(), node.position())),
            },
            Some(Frame::Done(_)) | None => self.stack.push(Frame::Done(node)),
        }
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, event: Event, mark: Marker) {
        let pos = Position::from(mark);
        match event {
            Event::Scalar(text, ..) => self.push(Node::Scalar(pos), Some(text)),
            Event::Alias(_) => self.push(Node::Scalar(pos), None),
            Event::SequenceStart(..) => self.stack.push(Frame::Seq(pos, Vec::new())),
            Event::MappingStart(..) => self.stack.push(Frame::Map(pos, Vec::new(), None)),
            Event::SequenceEnd | Event::MappingEnd => {
                let node = match self.stack.pop() {
                    Some(Frame::Seq(p, items)) => Node::Seq(p, items),
                    Some(Frame::Map(p, entries, _)) => Node::Map(p, entries),
                    _ => return,
                };
                self.push(node, None);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "\
a: 1
list:
  - name: x
  - name: y
    inner:
      deep: [1, 2]
";

    #[test]
    fn finds_keys_and_items() {
        let l = Locator::new(DOC);
        assert_eq!(l.find("a"), Some(Position { line: 1, column: 1 }));
        assert_eq!(
            l.find("list[1].name"),
            Some(Position { line: 4, column: 5 })
        );
        assert_eq!(
            l.find("list[1].inner.deep"),
            Some(Position { line: 6, column: 7 })
        );
    }

    #[test]
    fn missing_tail_reports_deepest_existing_node() {
        let l = Locator::new(DOC);
        assert_eq!(
            l.find("list[1].nope"),
            Some(Position { line: 4, column: 5 })
        );
        assert_eq!(l.find("list[7]"), Some(Position { line: 2, column: 1 }));
    }
}
