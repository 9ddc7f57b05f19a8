//! Lexer and recursive-descent parser for filter expressions.

use regex::Regex;

use super::{Expr, Field, FilterError, Op};

#[derive(Debug, Clone, PartialEq)]
enum Token {
    LParen,
    RParen,
    Equal,
    NotEqual,
    /// A quoted or backtick string (never a keyword or selector).
    Quoted(String),
    /// A bare word: keyword, selector or unquoted value.
    Word(String),
}

fn describe(token: &Token) -> String {
    match token {
        Token::LParen => "(".to_owned(),
        Token::RParen => ")".to_owned(),
        Token::Equal => "==".to_owned(),
        Token::NotEqual => "!=".to_owned(),
        Token::Quoted(s) => format!("\"{s}\""),
        Token::Word(w) => w.clone(),
    }
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':' | '+')
}

fn lex(src: &str) -> Result<Vec<(usize, Token)>, FilterError> {
    let mut tokens = Vec::new();
    let mut chars = src.char_indices().peekable();
    while let Some(&(at, c)) = chars.peek() {
        match c {
            c if c.is_whitespace() => drop(chars.next()),
            '(' | ')' => {
                chars.next();
                tokens.push((
                    at,
                    if c == '(' {
                        Token::LParen
                    } else {
                        Token::RParen
                    },
                ));
            }
            '=' | '!' => {
                chars.next();
                match chars.next() {
                    Some((_, '=')) => tokens.push((
                        at,
                        if c == '=' {
                            Token::Equal
                        } else {
                            Token::NotEqual
                        },
                    )),
                    _ => {
                        return Err(FilterError::InvalidCharacter {
                            found: c,
                            offset: at,
                        });
                    }
                }
            }
            '"' | '`' => {
                chars.next();
                tokens.push((at, Token::Quoted(lex_string(&mut chars, c, at)?)));
            }
            c if is_word_char(c) => {
                let mut word = String::new();
                while let Some(&(_, c)) = chars.peek().filter(|(_, c)| is_word_char(*c)) {
                    word.push(c);
                    chars.next();
                }
                tokens.push((at, Token::Word(word)));
            }
            other => {
                return Err(FilterError::InvalidCharacter {
                    found: other,
                    offset: at,
                });
            }
        }
    }
    Ok(tokens)
}

/// Reads a string body up to `quote`; double-quoted strings honour `\"`, `\\`, `\n`, `\t`.
fn lex_string(
    chars: &mut std::iter::Peekable<std::str::CharIndices<'_>>,
    quote: char,
    start: usize,
) -> Result<String, FilterError> {
    let mut out = String::new();
    while let Some((_, c)) = chars.next() {
        match c {
            c if c == quote => return Ok(out),
            '\\' if quote == '"' => match chars.next() {
                Some((_, 'n')) => out.push('\n'),
                Some((_, 't')) => out.push('\t'),
                Some((_, 'r')) => out.push('\r'),
                Some((_, other)) => out.push(other),
                None => break,
            },
            c => out.push(c),
        }
    }
    Err(FilterError::UnterminatedString(start))
}

const KEYWORDS: [&str; 8] = [
    "and", "or", "not", "in", "contains", "matches", "is", "empty",
];

struct Parser {
    tokens: Vec<(usize, Token)>,
    pos: usize,
    /// Parentheses and `not`s open around the current position.
    depth: usize,
}

/// Parentheses and `not`s nested deeper than this are refused: each level is a few stack
/// frames (here and when the expression is evaluated or dropped), and thousands of them, which
/// a config entry can hold, would overflow the stack.
pub(super) const MAX_DEPTH: usize = 64;
/// Tokens in one expression at most: a chain of `and`s and `or`s is as deep as it is long.
pub(super) const MAX_TOKENS: usize = 4096;

/// Parses a whole expression.
pub(super) fn parse(src: &str) -> Result<Expr, FilterError> {
    let tokens = lex(src)?;
    if tokens.is_empty() {
        return Err(FilterError::Empty);
    }
    if tokens.len() > MAX_TOKENS {
        return Err(FilterError::TooLong(MAX_TOKENS));
    }
    let mut parser = Parser {
        tokens,
        pos: 0,
        depth: 0,
    };
    let expr = parser.or()?;
    match parser.tokens.get(parser.pos) {
        None => Ok(expr),
        Some((offset, token)) => Err(FilterError::UnexpectedToken {
            found: describe(token),
            offset: *offset,
            expected: "`and`, `or` or the end of the expression",
        }),
    }
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos).map(|(_, t)| t)
    }

    fn peek_keyword(&self, keyword: &str) -> bool {
        matches!(self.peek(), Some(Token::Word(w)) if w == keyword)
    }

    fn eat_keyword(&mut self, keyword: &str) -> bool {
        let found = self.peek_keyword(keyword);
        if found {
            self.pos += 1;
        }
        found
    }

    fn next(&mut self, expected: &'static str) -> Result<(usize, Token), FilterError> {
        let item = self
            .tokens
            .get(self.pos)
            .cloned()
            .ok_or(FilterError::UnexpectedEnd(expected))?;
        self.pos += 1;
        Ok(item)
    }

    fn unexpected(offset: usize, token: &Token, expected: &'static str) -> FilterError {
        FilterError::UnexpectedToken {
            found: describe(token),
            offset,
            expected,
        }
    }

    fn or(&mut self) -> Result<Expr, FilterError> {
        let mut left = self.and()?;
        while self.eat_keyword("or") {
            left = Expr::Or(Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Expr, FilterError> {
        let mut left = self.unary()?;
        while self.eat_keyword("and") {
            left = Expr::And(Box::new(left), Box::new(self.unary()?));
        }
        Ok(left)
    }

    /// Runs `f` one level deeper, within [`MAX_DEPTH`].
    fn nested<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, FilterError>,
    ) -> Result<T, FilterError> {
        if self.depth >= MAX_DEPTH {
            return Err(FilterError::TooDeep(MAX_DEPTH));
        }
        self.depth += 1;
        let result = f(self);
        self.depth -= 1;
        result
    }

    fn unary(&mut self) -> Result<Expr, FilterError> {
        if self.eat_keyword("not") {
            return Ok(Expr::Not(Box::new(self.nested(Self::unary)?)));
        }
        if self.peek() == Some(&Token::LParen) {
            self.pos += 1;
            let inner = self.nested(Self::or)?;
            return match self.next("`)`")? {
                (_, Token::RParen) => Ok(inner),
                (offset, token) => Err(Self::unexpected(offset, &token, "`)`")),
            };
        }
        self.match_expr()
    }

    /// `S op V`, `S is [not] empty`, or `V [not] in S`.
    fn match_expr(&mut self) -> Result<Expr, FilterError> {
        const EXPECTED: &str = "a selector or value";
        let (offset, first) = self.next(EXPECTED)?;
        let (text, quoted) = match first {
            Token::Word(w) if KEYWORDS.contains(&w.as_str()) => {
                return Err(Self::unexpected(offset, &Token::Word(w), EXPECTED));
            }
            Token::Word(w) => (w, false),
            Token::Quoted(s) => (s, true),
            other => return Err(Self::unexpected(offset, &other, EXPECTED)),
        };
        let negated = self.eat_keyword("not");
        self.operator(text, quoted, negated)
    }

    /// The operator after the first operand (`text`), and the rest of the match.
    fn operator(&mut self, text: String, quoted: bool, negated: bool) -> Result<Expr, FilterError> {
        let (op_offset, op) = self.next("an operator")?;
        match op {
            Token::Equal | Token::NotEqual if !negated => {
                let value = self.value()?;
                let not_equal = op == Token::NotEqual;
                let op_text = if not_equal { "!=" } else { "==" };
                Self::finish(&text, quoted, Op::Equal(value), op_text, not_equal)
            }
            Token::Word(w) if w == "is" && !negated => {
                let not = self.empty_tail()?;
                Self::finish(&text, quoted, Op::IsEmpty, "is empty", not)
            }
            Token::Word(w) if w == "in" => {
                let (sel_offset, selector) = self.next("a selector")?;
                let Token::Word(selector) = selector else {
                    return Err(Self::unexpected(sel_offset, &selector, "a selector"));
                };
                Self::finish(&selector, false, Op::Contains(text), "in", negated)
            }
            Token::Word(w) if w == "contains" => {
                let value = self.value()?;
                Self::finish(&text, quoted, Op::Contains(value), "contains", negated)
            }
            Token::Word(w) if w == "matches" => {
                let re = self.regex()?;
                Self::finish(&text, quoted, Op::Matches(re), "matches", negated)
            }
            other => Err(Self::unexpected(
                op_offset,
                &other,
                "`==`, `!=`, `is`, `in`, `not in`, `contains` or `matches`",
            )),
        }
    }

    /// `[not] empty` after `is`; true when negated.
    fn empty_tail(&mut self) -> Result<bool, FilterError> {
        let not = self.eat_keyword("not");
        match self.next("`empty`")? {
            (_, Token::Word(e)) if e == "empty" => Ok(not),
            (at, token) => Err(Self::unexpected(at, &token, "`empty`")),
        }
    }

    /// The pattern after `matches`, compiled.
    fn regex(&mut self) -> Result<Regex, FilterError> {
        let pattern = self.value()?;
        Regex::new(&pattern).map_err(|e| FilterError::InvalidRegex {
            reason: e.to_string(),
            pattern,
        })
    }

    /// A value: quoted string or bare word (not a keyword).
    fn value(&mut self) -> Result<String, FilterError> {
        match self.next("a value")? {
            (_, Token::Quoted(s)) => Ok(s),
            (at, Token::Word(w)) if KEYWORDS.contains(&w.as_str()) => {
                Err(Self::unexpected(at, &Token::Word(w), "a value"))
            }
            (_, Token::Word(w)) => Ok(w),
            (at, token) => Err(Self::unexpected(at, &token, "a value")),
        }
    }

    /// Resolves the selector and checks the operator fits it.
    fn finish(
        selector: &str,
        quoted: bool,
        op: Op,
        op_text: &'static str,
        negated: bool,
    ) -> Result<Expr, FilterError> {
        let parts: Vec<String> = selector.split('.').map(str::to_owned).collect();
        let field = (!quoted)
            .then(|| Field::resolve(&parts))
            .flatten()
            .ok_or_else(|| FilterError::UnknownSelector(selector.to_owned()))?;
        field.check(&op, op_text, selector)?;
        Ok(Expr::Match { field, op, negated })
    }
}
