//! The little JSON the front needs, without allocating: a strict scanner that accepts only
//! what serde_json accepts (and leaves anything unusual to the full shim), the escaping
//! serde_json writes, and the reply's two fields.
//!
//! Nothing here may panic or call outside this crate: no indexing (`get` only), no slice
//! comparison or copy (the byte loops below; `#![no_builtins]` keeps them loops).

/// A top-level field of the network configuration, as far as the front cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Absent,
    /// A string without escapes: the byte range of its content.
    Plain(usize, usize),
    /// Anything else (another type, `null`, an escaped string, given twice): the full shim decides.
    Other,
}

/// The fields of a network configuration the front reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    pub cni_version: Field,
    pub agent_socket: Field,
}

/// Byte-wise equality (no `memcmp`).
pub fn eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a.get(i) != b.get(i) {
            return false;
        }
        i += 1;
    }
    true
}

/// Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF).
pub fn utf8_ok(b: &[u8]) -> bool {
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c < 0x80 {
            i += 1;
            continue;
        }
        let (more, lo, hi) = match c {
            0xC2..=0xDF => (1, 0x80, 0xBF),
            0xE0 => (2, 0xA0, 0xBF),
            0xE1..=0xEC | 0xEE..=0xEF => (2, 0x80, 0xBF),
            0xED => (2, 0x80, 0x9F),
            0xF0 => (3, 0x90, 0xBF),
            0xF1..=0xF3 => (3, 0x80, 0xBF),
            0xF4 => (3, 0x80, 0x8F),
            _ => return false,
        };
        match b.get(i + 1) {
            Some(&x) if x >= lo && x <= hi => {}
            _ => return false,
        }
        let mut k = 2;
        while k <= more {
            match b.get(i + k) {
                Some(&x) if x & 0xC0 == 0x80 => {}
                _ => return false,
            }
            k += 1;
        }
        i += more + 1;
    }
    true
}

/// Deeper than this is left to the full shim (serde_json's own limit is 128).
const MAX_DEPTH: u32 = 64;
/// Numbers with more digits than this, or with an exponent, are left to the full shim:
/// serde_json refuses some of them (out of range), the front does not judge which.
const MAX_DIGITS: u32 = 15;

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn bump(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        if self.peek()? == c {
            self.i += 1;
            Some(())
        } else {
            None
        }
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let mut v = 0u32;
        let mut n = 0;
        while n < 4 {
            let d = match self.bump()? {
                c @ b'0'..=b'9' => c - b'0',
                c @ b'a'..=b'f' => c - b'a' + 10,
                c @ b'A'..=b'F' => c - b'A' + 10,
                _ => return None,
            };
            v = v * 16 + d as u32;
            n += 1;
        }
        Some(v)
    }

    /// After `\u`: one code point (a surrogate pair taken whole; a lone surrogate refused,
    /// as serde_json refuses it).
    fn code_point(&mut self) -> Option<u32> {
        let hi = self.hex4()?;
        if (0xD800..0xDC00).contains(&hi) {
            self.eat(b'\\')?;
            self.eat(b'u')?;
            let lo = self.hex4()?;
            if !(0xDC00..0xE000).contains(&lo) {
                return None;
            }
            Some(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00))
        } else if (0xDC00..0xE000).contains(&hi) {
            None
        } else {
            Some(hi)
        }
    }

    /// A string at its opening quote: the range of its raw content, and whether it had
    /// escapes. With `out`, its decoded content is written there too.
    fn string(&mut self, mut out: Option<&mut Out<'_>>) -> Option<(usize, usize, bool)> {
        self.eat(b'"')?;
        let start = self.i;
        let mut escaped = false;
        loop {
            match self.bump()? {
                b'"' => return Some((start, self.i - 1, escaped)),
                b'\\' => {
                    escaped = true;
                    let c = match self.bump()? {
                        b'"' => b'"',
                        b'\\' => b'\\',
                        b'/' => b'/',
                        b'b' => 0x08,
                        b'f' => 0x0c,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => {
                            let cp = self.code_point()?;
                            if let Some(o) = out.as_deref_mut() {
                                o.utf8(cp);
                            }
                            continue;
                        }
                        _ => return None,
                    };
                    if let Some(o) = out.as_deref_mut() {
                        o.byte(c);
                    }
                }
                0..=0x1f => return None,
                c => {
                    if let Some(o) = out.as_deref_mut() {
                        o.byte(c);
                    }
                }
            }
        }
    }

    fn digits(&mut self) -> u32 {
        let mut n = 0;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
            n += 1;
        }
        n
    }

    fn number(&mut self) -> Option<()> {
        let _ = self.eat(b'-');
        let mut digits = match self.bump()? {
            b'0' => 1,
            b'1'..=b'9' => 1 + self.digits(),
            _ => return None,
        };
        if self.peek() == Some(b'.') {
            self.i += 1;
            let n = self.digits();
            if n == 0 {
                return None;
            }
            digits += n;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) || digits > MAX_DIGITS {
            return None;
        }
        Some(())
    }

    /// An integer that fits an `i32` (no fraction, no exponent, no leading zero).
    fn int(&mut self) -> Option<i32> {
        let neg = self.eat(b'-').is_some();
        let first = self.peek()?;
        let mut v: i64 = 0;
        let mut n = 0;
        while let Some(c @ b'0'..=b'9') = self.peek() {
            self.i += 1;
            v = v * 10 + (c - b'0') as i64;
            n += 1;
            if n > 10 {
                return None;
            }
        }
        // `-0` too: serde_json reads it as a float (left to the full shim).
        if n == 0 || (first == b'0' && (n > 1 || neg)) || matches!(self.peek(), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        let v = if neg { -v } else { v };
        if v < i32::MIN as i64 || v > i32::MAX as i64 {
            return None;
        }
        Some(v as i32)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        for &c in word {
            self.eat(c)?;
        }
        Some(())
    }

    fn value(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        match self.peek()? {
            b'{' => {
                self.i += 1;
                self.ws();
                if self.peek()? == b'}' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.ws();
                    self.string(None)?;
                    self.ws();
                    self.eat(b':')?;
                    self.value(depth + 1)?;
                    self.ws();
                    match self.bump()? {
                        b',' => {}
                        b'}' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.i += 1;
                self.ws();
                if self.peek()? == b']' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.value(depth + 1)?;
                    self.ws();
                    match self.bump()? {
                        b',' => {}
                        b']' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b'"' => self.string(None).map(|_| ()),
            b'-' | b'0'..=b'9' => self.number(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => None,
        }
    }

    /// A whole document that is one object: `on_field(scanner, key)` is called at each
    /// top-level value (with the scanner before it) and must consume it. `None`: not such
    /// a document (or `on_field` refused).
    fn object(&mut self, mut on_field: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        let b = self.b;
        self.ws();
        self.eat(b'{')?;
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
        } else {
            loop {
                self.ws();
                let (ks, ke, escaped) = self.string(None)?;
                if escaped {
                    // It might spell a field we read: let the full shim decode it.
                    return None;
                }
                let key = b.get(ks..ke)?;
                self.ws();
                self.eat(b':')?;
                self.ws();
                on_field(self, key)?;
                self.ws();
                match self.bump()? {
                    b',' => {}
                    b'}' => break,
                    _ => return None,
                }
            }
        }
        self.ws();
        if self.i != b.len() {
            return None;
        }
        Some(())
    }
}

/// Scan a network configuration: `None` unless it is valid UTF-8 and one JSON object that
/// serde_json would read too.
pub fn scan_config(b: &[u8]) -> Option<Config> {
    if !utf8_ok(b) {
        return None;
    }
    let mut conf = Config { cni_version: Field::Absent, agent_socket: Field::Absent };
    let mut s = Scan { b, i: 0 };
    s.object(|s, key| {
        let slot = if eq(key, b"cniVersion") {
            Some(&mut conf.cni_version)
        } else if eq(key, b"agentSocket") {
            Some(&mut conf.agent_socket)
        } else {
            None
        };
        let plain = if s.peek()? == b'"' {
            let (vs, ve, escaped) = s.string(None)?;
            (!escaped).then_some((vs, ve))
        } else {
            s.value(1)?;
            None
        };
        if let Some(slot) = slot {
            *slot = match (*slot, plain) {
                (Field::Absent, Some((vs, ve))) => Field::Plain(vs, ve),
                _ => Field::Other,
            };
        }
        Some(())
    })?;
    Some(conf)
}

/// The agent's reply (`{"exit_code": N, "stdout": "..."}`): its exit code, with the
/// decoded stdout written to `out`. `None`: not such a reply (or `out` is too small).
pub fn decode_reply(body: &[u8], out: &mut Out<'_>) -> Option<i32> {
    if !utf8_ok(body) {
        return None;
    }
    let mut code = None;
    let mut stdout = false;
    let mut s = Scan { b: body, i: 0 };
    s.object(|s, key| {
        if eq(key, b"exit_code") {
            if code.is_some() {
                return None;
            }
            code = Some(s.int()?);
        } else if eq(key, b"stdout") {
            if stdout {
                return None;
            }
            stdout = true;
            s.string(Some(&mut *out))?;
        } else {
            s.value(1)?;
        }
        Some(())
    })?;
    if !stdout || out.overflow {
        return None;
    }
    code
}

/// Bytes written into a fixed buffer; what does not fit sets `overflow`.
pub struct Out<'a> {
    buf: &'a mut [u8],
    len: usize,
    overflow: bool,
}

impl<'a> Out<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Out { buf, len: 0, overflow: false }
    }

    pub fn byte(&mut self, c: u8) {
        match self.buf.get_mut(self.len) {
            Some(slot) => {
                *slot = c;
                self.len += 1;
            }
            None => self.overflow = true,
        }
    }

    pub fn bytes(&mut self, s: &[u8]) {
        for &c in s {
            self.byte(c);
        }
    }

    /// One code point, UTF-8 encoded.
    pub fn utf8(&mut self, cp: u32) {
        if cp < 0x80 {
            self.byte(cp as u8);
        } else if cp < 0x800 {
            self.byte(0xC0 | (cp >> 6) as u8);
            self.byte(0x80 | (cp & 0x3F) as u8);
        } else if cp < 0x10000 {
            self.byte(0xE0 | (cp >> 12) as u8);
            self.byte(0x80 | ((cp >> 6) & 0x3F) as u8);
            self.byte(0x80 | (cp & 0x3F) as u8);
        } else {
            self.byte(0xF0 | (cp >> 18) as u8);
            self.byte(0x80 | ((cp >> 12) & 0x3F) as u8);
            self.byte(0x80 | ((cp >> 6) & 0x3F) as u8);
            self.byte(0x80 | (cp & 0x3F) as u8);
        }
    }

    /// `s` (UTF-8) as a JSON string, escaped the way serde_json escapes.
    pub fn json_str(&mut self, s: &[u8]) {
        self.byte(b'"');
        for &c in s {
            match c {
                b'"' => self.bytes(b"\\\""),
                b'\\' => self.bytes(b"\\\\"),
                0x08 => self.bytes(b"\\b"),
                0x0c => self.bytes(b"\\f"),
                b'\n' => self.bytes(b"\\n"),
                b'\r' => self.bytes(b"\\r"),
                b'\t' => self.bytes(b"\\t"),
                0..=0x1f => {
                    self.bytes(b"\\u00");
                    self.byte(hex(c >> 4));
                    self.byte(hex(c & 0xF));
                }
                _ => self.byte(c),
            }
        }
        self.byte(b'"');
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn overflowed(&self) -> bool {
        self.overflow
    }

    pub fn written(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or(&[])
    }
}

fn hex(n: u8) -> u8 {
    if n < 10 { b'0' + n } else { b'a' + n - 10 }
}

/// The versions the plugin speaks, oldest first (the same list as
/// `nodeplane_cni::cni::SUPPORTED_VERSIONS`; a test there compares them).
pub const SUPPORTED: [&[u8]; 5] = [b"0.3.0", b"0.3.1", b"0.4.0", b"1.0.0", b"1.1.0"];
pub const LATEST: &[u8] = b"1.1.0";

/// The VERSION answer for a configuration that asked for `requested`, exactly as the full
/// shim prints it (serde_json's compact form, keys sorted).
pub fn version_answer(requested: Option<&[u8]>, out: &mut Out<'_>) {
    let mut v = LATEST;
    if let Some(r) = requested {
        for s in SUPPORTED {
            if eq(s, r) {
                v = s;
            }
        }
    }
    out.bytes(b"{\"cniVersion\":");
    out.json_str(v);
    out.bytes(b",\"supportedVersions\":[");
    let mut first = true;
    for s in SUPPORTED {
        if !first {
            out.byte(b',');
        }
        first = false;
        out.json_str(s);
    }
    out.bytes(b"]}");
}

/// The wire request (`{"env":{...},"stdin":"..."}`, the env keys sorted as the full shim's
/// map sorts them), its 4-byte big-endian length first.
pub fn encode_request(env: &[(&[u8], &[u8])], stdin: &[u8], out: &mut Out<'_>) -> Option<()> {
    out.bytes(&[0, 0, 0, 0]);
    out.bytes(b"{\"env\":{");
    let mut first = true;
    for (k, v) in env {
        if !first {
            out.byte(b',');
        }
        first = false;
        out.json_str(k);
        out.byte(b':');
        out.json_str(v);
    }
    out.bytes(b"},\"stdin\":");
    out.json_str(stdin);
    out.byte(b'}');
    if out.overflow {
        return None;
    }
    let body = u32::try_from(out.len - 4).ok()?;
    let be = body.to_be_bytes();
    let mut i = 0;
    while i < 4 {
        *out.buf.get_mut(i)? = *be.get(i)?;
        i += 1;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    fn conf(s: &str) -> Option<Config> {
        scan_config(s.as_bytes())
    }

    #[test]
    fn scans_the_fields_it_reads_and_refuses_what_serde_json_refuses() {
        let text = r#"{"cniVersion":"1.0.0","x":[1,2.5,{"y":null}],"agentSocket":"/run/a.sock"}"#;
        let c = conf(text).unwrap();
        let at = |v: &str| text.find(v).unwrap();
        assert_eq!(c.cni_version, Field::Plain(at("1.0.0"), at("1.0.0") + 5));
        assert_eq!(c.agent_socket, Field::Plain(at("/run/a.sock"), at("/run/a.sock") + 11));
        assert_eq!(conf("{}").unwrap().cni_version, Field::Absent);
        assert_eq!(conf(r#" { "cniVersion" : 1 } "#).unwrap().cni_version, Field::Other);
        assert_eq!(conf(r#"{"cniVersion":"1.0.0","cniVersion":"1.0.0"}"#).unwrap().cni_version, Field::Other);
        assert_eq!(conf(r#"{"agentSocket":"\/run"}"#).unwrap().agent_socket, Field::Other);
        assert_eq!(conf(r#"{"agentSocket":null}"#).unwrap().agent_socket, Field::Other);
        for bad in [
            "",
            "[]",
            "{",
            "{}x",
            r#"{"a":01}"#,
            r#"{"a":1.}"#,
            r#"{"a":1e5}"#,
            r#"{"a":1,}"#,
            r#"{"a":tru}"#,
            "{\"a\":\"\u{1}\"}",
            r#"{"a":"\ud800"}"#,
            r#"{"a":"\x"}"#,
            r#"{"cni\u0056ersion":"1.0.0"}"#,
            r#"{"a":12345678901234567890}"#,
        ] {
            assert_eq!(conf(bad), None, "{bad:?}");
        }
        let deep = "[".repeat(70) + &"]".repeat(70);
        assert_eq!(conf(&std::format!(r#"{{"a":{deep}}}"#)), None);
        assert!(scan_config(b"{\"a\":\"\xff\"}").is_none());
        assert!(conf(r#"{"a":"\ud83d\ude00 \u00e9","b":-0.5,"c":[true,false]}"#).is_some());
    }

    #[test]
    fn utf8_is_strict() {
        for ok in ["", "abc", "é", "€", "😀"] {
            assert!(utf8_ok(ok.as_bytes()), "{ok:?}");
        }
        for bad in [&b"\xc0\x80"[..], b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80", b"\xf8"] {
            assert!(!utf8_ok(bad), "{bad:?}");
        }
    }

    #[test]
    fn decodes_a_reply() {
        let mut buf = [0u8; 64];
        let mut out = Out::new(&mut buf);
        assert_eq!(decode_reply(br#"{"exit_code":1,"stdout":"a\"b\n\u00e9\ud83d\ude00"}"#, &mut out), Some(1));
        assert_eq!(out.written(), "a\"b\né😀".as_bytes());
        for bad in [
            &br#"{"exit_code":1}"#[..],
            br#"{"stdout":""}"#,
            br#"{"exit_code":1.0,"stdout":""}"#,
            br#"{"exit_code":01,"stdout":""}"#,
            br#"{"exit_code":-0,"stdout":""}"#,
            br#"{"exit_code":99999999999,"stdout":""}"#,
            br#"{"exit_code":0,"stdout":"","stdout":""}"#,
        ] {
            let mut buf = [0u8; 64];
            assert_eq!(decode_reply(bad, &mut Out::new(&mut buf)), None, "{:?}", std::str::from_utf8(bad));
        }
        let mut small = [0u8; 2];
        assert_eq!(decode_reply(br#"{"exit_code":0,"stdout":"abc"}"#, &mut Out::new(&mut small)), None);
        let mut buf = [0u8; 8];
        assert_eq!(decode_reply(br#"{"x":[1],"stdout":"","exit_code":-2}"#, &mut Out::new(&mut buf)), Some(-2));
    }

    #[test]
    fn encodes_a_request_with_its_length() {
        let mut buf = std::vec![0u8; 256];
        let mut out = Out::new(&mut buf);
        let env: [(&[u8], &[u8]); 2] = [(b"CNI_ARGS", b"a=\"1\""), (b"CNI_COMMAND", b"ADD")];
        encode_request(&env, b"{\"x\":\"\x01\t\"}", &mut out).unwrap();
        let w: Vec<u8> = out.written().to_vec();
        let len = u32::from_be_bytes([w[0], w[1], w[2], w[3]]) as usize;
        assert_eq!(len, w.len() - 4);
        assert_eq!(
            std::str::from_utf8(&w[4..]).unwrap(),
            r#"{"env":{"CNI_ARGS":"a=\"1\"","CNI_COMMAND":"ADD"},"stdin":"{\"x\":\"\u0001\t\"}"}"#
        );
        let mut tiny = [0u8; 8];
        assert_eq!(encode_request(&env, b"{}", &mut Out::new(&mut tiny)), None);
    }
}
