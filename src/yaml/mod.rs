//! Rule files as YAML 1.2 trees whose every node knows its line and column, and the decoding
//! helpers that turn them into typed values while collecting every problem with its location.
//!
//! Below `config` and `channel` alike: a channel integration decodes its own fields with
//! these helpers, so `config` can hand it the node without knowing the integration.
//!
//! We build the tree ourselves from saphyr-parser's events instead of deserializing with serde:
//! serde stops at the first error and forgets where values came from, while `keywatch check` must
//! report every problem, including semantic ones (an unknown channel, a bad cron) at the line of
//! the offending value. YAML 1.2's core schema applies: `on`, `yes`, `no` are plain strings.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use saphyr_parser::{Event, Parser, ScalarStyle, Span};

pub(crate) mod decode;
pub(crate) mod diagnostic;
pub(crate) mod env;
mod secret;

pub use secret::{Secret, Secrets, mask_user_info};

use diagnostic::{Diagnostics, Loc};

/// A node of a parsed document.
#[derive(Clone, Debug)]
pub struct Node {
    pub loc: Loc,
    pub kind: Kind,
}

#[derive(Clone, Debug)]
pub enum Kind {
    /// `~`, `null`, or nothing at all.
    Null,
    /// Any other scalar, as written. `plain` is false for quoted and block scalars: a quoted
    /// `"true"` is text, never a boolean.
    Scalar {
        text: String,
        plain: bool,
    },
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

impl Node {
    /// What a user would call this kind of value, for "expected X, found Y" messages.
    pub fn kind_name(&self) -> &'static str {
        match &self.kind {
            Kind::Null => "nothing",
            Kind::Scalar { .. } => "a scalar",
            Kind::Seq(_) => "a list",
            Kind::Map(_) => "a mapping",
        }
    }
}

/// Aliases are expanded by copying; this bound keeps a "billion laughs" file from eating memory.
const MAX_NODES: usize = 200_000;

/// Parses `text` (the content of `file`) into its documents. Syntax errors, duplicate keys and
/// unknown aliases are reported into `diags`; a document with a syntax error is dropped whole.
pub fn parse(file: &Arc<Path>, text: &str, diags: &mut Diagnostics) -> Vec<Node> {
    let mut builder = Builder {
        file: file.clone(),
        anchors: HashMap::new(),
        stack: Vec::new(),
        docs: Vec::new(),
        nodes: 0,
    };
    let mut parser = Parser::new_from_str(text);
    while let Some(next) = parser.next_event() {
        match next {
            Ok((event, span)) => {
                if let Err((loc, msg)) = builder.event(event, span, diags) {
                    diags.error(&loc, msg);
                    return builder.docs;
                }
            }
            Err(e) => {
                let m = e.marker();
                let loc = Loc::new(file, m.line(), m.col() + 1);
                diags.error(&loc, format!("invalid YAML: {}", e.info()));
                return builder.docs;
            }
        }
    }
    builder.docs
}

enum Frame {
    Seq {
        loc: Loc,
        anchor: usize,
        items: Vec<Node>,
    },
    Map {
        loc: Loc,
        anchor: usize,
        entries: Vec<(Node, Node)>,
        pending_key: Option<Node>,
    },
}

struct Builder {
    file: Arc<Path>,
    anchors: HashMap<usize, Node>,
    stack: Vec<Frame>,
    docs: Vec<Node>,
    nodes: usize,
}

impl Builder {
    fn loc(&self, span: Span) -> Loc {
        Loc::new(&self.file, span.start.line(), span.start.col() + 1)
    }

    fn event(
        &mut self,
        event: Event<'_>,
        span: Span,
        diags: &mut Diagnostics,
    ) -> Result<(), (Loc, String)> {
        match event {
            Event::Nothing | Event::StreamStart | Event::StreamEnd | Event::DocumentStart(_) => {}
            Event::DocumentEnd => {}
            Event::Alias(id) => {
                let loc = self.loc(span);
                let node = match self.anchors.get(&id) {
                    Some(n) => n.clone(),
                    None => return Err((loc, "alias to an unknown anchor".into())),
                };
                self.count(&node, &loc)?;
                self.finish_node(node, 0, diags);
            }
            Event::Scalar(text, style, anchor, tag) => {
                let loc = self.loc(span);
                let plain =
                    style == ScalarStyle::Plain && tag.as_ref().is_none_or(|t| t.suffix != "str");
                let kind = if plain && is_null(&text) {
                    Kind::Null
                } else {
                    Kind::Scalar {
                        text: text.into_owned(),
                        plain,
                    }
                };
                self.nodes += 1;
                self.finish_node(Node { loc, kind }, anchor, diags);
            }
            Event::SequenceStart(anchor, _) => {
                let loc = self.loc(span);
                self.stack.push(Frame::Seq {
                    loc,
                    anchor,
                    items: Vec::new(),
                });
            }
            Event::MappingStart(anchor, _) => {
                let loc = self.loc(span);
                self.stack.push(Frame::Map {
                    loc,
                    anchor,
                    entries: Vec::new(),
                    pending_key: None,
                });
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let (node, anchor) = match self.stack.pop() {
                    Some(Frame::Seq { loc, anchor, items }) => (
                        Node {
                            loc,
                            kind: Kind::Seq(items),
                        },
                        anchor,
                    ),
                    Some(Frame::Map {
                        loc,
                        anchor,
                        entries,
                        ..
                    }) => (
                        Node {
                            loc,
                            kind: Kind::Map(entries),
                        },
                        anchor,
                    ),
                    None => return Err((self.loc(span), "unbalanced YAML structure".into())),
                };
                self.nodes += 1;
                self.finish_node(node, anchor, diags);
            }
        }
        if self.nodes > MAX_NODES {
            return Err((
                self.loc(span),
                format!(
                    "document too large (more than {MAX_NODES} values after expanding aliases)"
                ),
            ));
        }
        Ok(())
    }

    fn count(&mut self, node: &Node, loc: &Loc) -> Result<(), (Loc, String)> {
        fn size(n: &Node) -> usize {
            match &n.kind {
                Kind::Seq(items) => 1 + items.iter().map(size).sum::<usize>(),
                Kind::Map(entries) => {
                    1 + entries
                        .iter()
                        .map(|(k, v)| size(k) + size(v))
                        .sum::<usize>()
                }
                _ => 1,
            }
        }
        self.nodes += size(node);
        if self.nodes > MAX_NODES {
            return Err((
                loc.clone(),
                format!(
                    "document too large (more than {MAX_NODES} values after expanding aliases)"
                ),
            ));
        }
        Ok(())
    }

    fn finish_node(&mut self, node: Node, anchor: usize, diags: &mut Diagnostics) {
        if anchor != 0 {
            self.anchors.insert(anchor, node.clone());
        }
        match self.stack.last_mut() {
            None => self.docs.push(node),
            Some(Frame::Seq { items, .. }) => items.push(node),
            Some(Frame::Map {
                entries,
                pending_key,
                ..
            }) => match pending_key.take() {
                None => *pending_key = Some(node),
                Some(key) => {
                    if let Kind::Scalar { text, .. } = &key.kind {
                        let earlier = entries.iter().find(|(k, _)| match &k.kind {
                            Kind::Scalar { text: t, .. } => t == text,
                            _ => false,
                        });
                        if let Some((first, _)) = earlier {
                            diags.error(
                                &key.loc,
                                format!(
                                    "duplicate key `{text}` (first defined at line {})",
                                    first.loc.line
                                ),
                            );
                            return;
                        }
                    }
                    entries.push((key, node));
                }
            },
        }
    }
}

/// YAML 1.2 core schema nulls.
fn is_null(text: &str) -> bool {
    matches!(text, "" | "~" | "null" | "Null" | "NULL")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_one(text: &str) -> (Vec<Node>, Vec<String>) {
        let file: Arc<Path> = Arc::from(Path::new("t.yaml"));
        let mut d = Diagnostics::default();
        let docs = parse(&file, text, &mut d);
        let msgs = d
            .into_sorted(&|_| 0)
            .iter()
            .map(|d| d.to_string())
            .collect();
        (docs, msgs)
    }

    #[test]
    fn nodes_know_their_place() {
        let (docs, errs) = parse_one("a: 1\nb:\n  - x\n  - \"y\"\n");
        assert!(errs.is_empty(), "{errs:?}");
        let Kind::Map(entries) = &docs[0].kind else {
            panic!()
        };
        assert_eq!((entries[1].0.loc.line, entries[1].0.loc.col), (2, 1));
        let Kind::Seq(items) = &entries[1].1.kind else {
            panic!()
        };
        assert_eq!((items[1].loc.line, items[1].loc.col), (4, 5));
        assert!(matches!(&items[1].kind, Kind::Scalar { plain: false, .. }));
    }

    #[test]
    fn yaml_1_2_keeps_on_and_yes_as_text() {
        let (docs, _) = parse_one("on: yes\nx: ~\n");
        let Kind::Map(entries) = &docs[0].kind else {
            panic!()
        };
        assert!(matches!(&entries[0].0.kind, Kind::Scalar { text, .. } if text == "on"));
        assert!(matches!(&entries[0].1.kind, Kind::Scalar { text, plain: true } if text == "yes"));
        assert!(matches!(&entries[1].1.kind, Kind::Null));
    }

    #[test]
    fn duplicate_keys_name_both_lines() {
        let (_, errs) = parse_one("a: 1\nb: 2\na: 3\n");
        assert_eq!(
            errs,
            ["t.yaml:3:1: duplicate key `a` (first defined at line 1)"]
        );
    }

    #[test]
    fn syntax_errors_have_a_place() {
        let (_, errs) = parse_one("a: [1, 2\nb: 3\n");
        assert_eq!(errs.len(), 1);
        assert!(errs[0].starts_with("t.yaml:"), "{errs:?}");
        assert!(errs[0].contains("invalid YAML"), "{errs:?}");
    }

    #[test]
    fn aliases_expand_and_bombs_stop() {
        let (docs, errs) = parse_one("a: &x [1, 2]\nb: *x\n");
        assert!(errs.is_empty());
        let Kind::Map(entries) = &docs[0].kind else {
            panic!()
        };
        assert!(matches!(&entries[1].1.kind, Kind::Seq(items) if items.len() == 2));

        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..8 {
            let p = i - 1;
            bomb.push_str(&format!("a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"));
        }
        let (_, errs) = parse_one(&bomb);
        assert!(errs.iter().any(|e| e.contains("too large")), "{errs:?}");
    }
}
