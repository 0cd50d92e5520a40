//! HTTP/2 `:authority` as real clients send it over a Unix socket.
//!
//! kubelet's plugin watcher dials `plugins_registry/*.sock` with grpc-go and no authority
//! override, so the `:authority` pseudo-header it sends is the socket path, percent-encoded
//! (`%2Fvar%2Flib%2Fkubelet%2F…`); grpcio (Python) ≥ 1.57, grpc-java and swift send the path
//! too, and other tools send the raw path. h2 — the HTTP/2 server under tonic — parses the
//! value as a URI authority and answers anything that does not parse with RST_STREAM
//! PROTOCOL_ERROR before the request reaches a service. The authority means nothing on a Unix
//! socket (tonic routes by `:path`), so every Unix-socket server of the agent and the
//! controller reads its connections through [`NormalisedStream`]: an HTTP/2 front that
//! rewrites, on the way in, an `:authority` that h2 would refuse to `localhost` (what
//! kubelet's own device-plugin and CSI clients send) and passes everything else on.
//!
//! How: the client→server byte stream is cut into frames. Frames other than HEADERS and
//! CONTINUATION pass through untouched (DATA is streamed, never buffered whole). Each header
//! block (HEADERS plus its CONTINUATIONs) is HPACK-decoded with the client's dynamic table
//! (`loona-hpack`) and sent on re-encoded as literals without indexing, so the server's HPACK
//! table stays empty and can never disagree with the client's. Padding is dropped; priority,
//! END_STREAM and the stream id are kept. Server→client bytes are not touched.
//!
//! The same rewriter, told to *set* the authority, is what a test client uses to dial exactly
//! as kubelet does ([`connect_unix_with_authority`]): tonic's own client cannot send an
//! authority that is not a valid URI authority.

use std::borrow::Cow;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface (RFC 9113 §3.4), passed through as it is.
const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Frames we emit never exceed the protocol's minimum SETTINGS_MAX_FRAME_SIZE, which every
/// peer must accept.
const OUT_FRAME_MAX: usize = 16_384;
/// A compressed header block (HEADERS + CONTINUATIONs) larger than this closes the
/// connection. gRPC metadata is a few hundred bytes; hyper refuses decoded lists over 16 KiB.
pub const MAX_BLOCK: usize = 1 << 20;
/// Decoded header list size (RFC 9113 counting: name + value + 32 per field) over which the
/// connection is closed; four times what the server behind accepts.
pub const MAX_DECODED: usize = 64 << 10;
/// Largest HPACK dynamic table a client may ask us to keep.
const MAX_TABLE: usize = 64 << 10;
/// What an authority that the server cannot parse becomes.
pub const LOCALHOST: &[u8] = b"localhost";

/// What to do with `:authority` in each header block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// Server side: replace a value that is not a valid URI authority with `localhost`;
    /// leave valid values (and an absent header) as they are.
    Normalise,
    /// Client side (tests): send this value, or no `:authority` at all for `None`.
    Set(Option<Vec<u8>>),
}

#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("HTTP/2 header block: {0}")]
    Protocol(&'static str),
    #[error("HTTP/2 header block over {limit} bytes")]
    TooLarge { limit: usize },
    #[error("HPACK: {0}")]
    Hpack(String),
}

impl From<RewriteError> for io::Error {
    fn from(e: RewriteError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Bytes of the connection preface still to pass on.
    Preface(usize),
    /// At a frame boundary.
    Frame,
    /// Payload bytes of a frame that passes through untouched.
    Passthrough(usize),
}

struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// Sans-IO rewriter of one direction (client→server) of one HTTP/2 connection.
pub struct Rewriter {
    policy: Policy,
    decoder: loona_hpack::Decoder<'static>,
    state: State,
    block: Option<PendingBlock>,
}

impl Rewriter {
    pub fn new(policy: Policy) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        Rewriter { policy, decoder, state: State::Preface(PREFACE_LEN), block: None }
    }

    /// Bytes of the current frame's payload still to pass on untouched, if the rewriter is
    /// in the middle of a frame it does not touch.
    fn passthrough_left(&self) -> usize {
        match self.state {
            State::Preface(n) | State::Passthrough(n) => n,
            State::Frame => 0,
        }
    }

    /// Account for `n` bytes passed on untouched (at most [`Self::passthrough_left`]).
    fn consumed_passthrough(&mut self, n: usize) {
        self.state = match self.state {
            State::Preface(left) if left > n => State::Preface(left - n),
            State::Passthrough(left) if left > n => State::Passthrough(left - n),
            _ => State::Frame,
        };
    }

    /// Move everything that can be decided from `input` to `out`; an incomplete frame header
    /// or header frame stays in `input` until more arrives.
    pub fn process(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Result<(), RewriteError> {
        loop {
            let left = self.passthrough_left();
            if left > 0 {
                let n = left.min(input.len());
                if n == 0 {
                    return Ok(());
                }
                out.extend_from_slice(&input[..n]);
                input.advance(n);
                self.consumed_passthrough(n);
                continue;
            }
            if input.len() < FRAME_HEADER_LEN {
                return Ok(());
            }
            let len = (usize::from(input[0]) << 16) | (usize::from(input[1]) << 8) | usize::from(input[2]);
            let (kind, flags) = (input[3], input[4]);
            let stream_id = u32::from_be_bytes([input[5], input[6], input[7], input[8]]) & 0x7fff_ffff;
            if kind != TYPE_HEADERS && kind != TYPE_CONTINUATION {
                if self.block.is_some() {
                    return Err(RewriteError::Protocol("a header block was interrupted by another frame"));
                }
                out.extend_from_slice(&input[..FRAME_HEADER_LEN]);
                input.advance(FRAME_HEADER_LEN);
                self.state = if len > 0 { State::Passthrough(len) } else { State::Frame };
                continue;
            }
            if len > MAX_BLOCK {
                return Err(RewriteError::TooLarge { limit: MAX_BLOCK });
            }
            if input.len() < FRAME_HEADER_LEN + len {
                input.reserve(FRAME_HEADER_LEN + len - input.len());
                return Ok(());
            }
            let frame = input.split_to(FRAME_HEADER_LEN + len);
            self.header_frame(kind, flags, stream_id, &frame[FRAME_HEADER_LEN..], out)?;
        }
    }

    fn header_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream_id: u32,
        payload: &[u8],
        out: &mut BytesMut,
    ) -> Result<(), RewriteError> {
        if kind == TYPE_HEADERS {
            if self.block.is_some() {
                return Err(RewriteError::Protocol("HEADERS while a header block was open"));
            }
            let mut p = payload;
            if flags & FLAG_PADDED != 0 {
                let (&pad, rest) =
                    p.split_first().ok_or(RewriteError::Protocol("PADDED HEADERS without a pad length"))?;
                let keep = rest
                    .len()
                    .checked_sub(usize::from(pad))
                    .ok_or(RewriteError::Protocol("padding longer than the frame"))?;
                p = &rest[..keep];
            }
            let priority = if flags & FLAG_PRIORITY != 0 {
                if p.len() < 5 {
                    return Err(RewriteError::Protocol("PRIORITY HEADERS shorter than its priority fields"));
                }
                let (pr, rest) = p.split_at(5);
                p = rest;
                Some([pr[0], pr[1], pr[2], pr[3], pr[4]])
            } else {
                None
            };
            self.block = Some(PendingBlock {
                stream_id,
                end_stream: flags & FLAG_END_STREAM != 0,
                priority,
                fragment: p.to_vec(),
            });
        } else {
            let block = self.block.as_mut().ok_or(RewriteError::Protocol("CONTINUATION without a header block"))?;
            if block.stream_id != stream_id {
                return Err(RewriteError::Protocol("CONTINUATION on another stream"));
            }
            if block.fragment.len() + payload.len() > MAX_BLOCK {
                return Err(RewriteError::TooLarge { limit: MAX_BLOCK });
            }
            block.fragment.extend_from_slice(payload);
        }
        if flags & FLAG_END_HEADERS == 0 {
            return Ok(());
        }
        let block = self.block.take().expect("a header block is open here");
        let fields = self.decode(&block.fragment)?;
        emit(&block, &encode(&apply(&self.policy, fields)), out);
        Ok(())
    }

    fn decode(&mut self, fragment: &[u8]) -> Result<Fields, RewriteError> {
        let mut fields = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(fragment, |n: Cow<[u8]>, v: Cow<[u8]>| {
                size = size.saturating_add(n.len() + v.len() + 32);
                if size <= MAX_DECODED {
                    fields.push((n.into_owned(), v.into_owned()));
                }
            })
            .map_err(|e| RewriteError::Hpack(e.to_string()))?;
        if size > MAX_DECODED {
            return Err(RewriteError::TooLarge { limit: MAX_DECODED });
        }
        Ok(fields)
    }
}

/// Is `v` an authority h2 accepts (the same parser it uses)?
pub fn valid_authority(v: &[u8]) -> bool {
    tonic::codegen::http::uri::Authority::try_from(v).is_ok()
}

/// A header block's fields: name and value.
type Fields = Vec<(Vec<u8>, Vec<u8>)>;

fn apply(policy: &Policy, mut fields: Fields) -> Fields {
    let is_authority = |n: &[u8]| n == b":authority";
    match policy {
        Policy::Normalise => {
            for (n, v) in fields.iter_mut() {
                if is_authority(n) && !valid_authority(v) {
                    *v = LOCALHOST.to_vec();
                }
            }
        }
        Policy::Set(value) => {
            // Only request header blocks carry pseudo-headers; trailers stay as they are.
            if fields.iter().any(|(n, _)| n.first() == Some(&b':')) {
                fields.retain(|(n, _)| !is_authority(n));
                if let Some(v) = value {
                    fields.insert(0, (b":authority".to_vec(), v.clone()));
                }
            }
        }
    }
    fields
}

/// HPACK literal header fields without indexing, new name, no Huffman (RFC 7541 §6.2.2).
fn encode(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.iter().map(|(n, v)| n.len() + v.len() + 8).sum());
    for (n, v) in fields {
        out.push(0x00);
        for s in [n, v] {
            // Writing into a Vec cannot fail.
            let _ = loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, &mut out);
            out.extend_from_slice(s);
        }
    }
    out
}

/// One header block as HEADERS (+ CONTINUATION) frames of at most [`OUT_FRAME_MAX`] bytes.
fn emit(block: &PendingBlock, encoded: &[u8], out: &mut BytesMut) {
    let frame = |out: &mut BytesMut, kind: u8, flags: u8, prefix: &[u8], body: &[u8]| {
        let len = prefix.len() + body.len();
        out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        out.extend_from_slice(&block.stream_id.to_be_bytes());
        out.extend_from_slice(prefix);
        out.extend_from_slice(body);
    };
    let prio: &[u8] = block.priority.as_ref().map_or(&[], |p| &p[..]);
    let first = encoded.len().min(OUT_FRAME_MAX - prio.len());
    let (head, mut rest) = encoded.split_at(first);
    let mut flags = if block.end_stream { FLAG_END_STREAM } else { 0 };
    if block.priority.is_some() {
        flags |= FLAG_PRIORITY;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    frame(out, TYPE_HEADERS, flags, prio, head);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(OUT_FRAME_MAX));
        rest = tail;
        frame(out, TYPE_CONTINUATION, if rest.is_empty() { FLAG_END_HEADERS } else { 0 }, &[], chunk);
    }
}

/// A server-side connection whose incoming `:authority` is normalised ([`Policy::Normalise`]).
pub struct NormalisedStream<S> {
    inner: S,
    rw: Rewriter,
    /// Read from `inner`, not yet decided.
    raw: BytesMut,
    /// Decided, not yet handed to the reader.
    out: BytesMut,
    eof: bool,
}

impl<S> NormalisedStream<S> {
    pub fn new(inner: S) -> Self {
        NormalisedStream {
            inner,
            rw: Rewriter::new(Policy::Normalise),
            raw: BytesMut::new(),
            out: BytesMut::new(),
            eof: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for NormalisedStream<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        loop {
            if !me.out.is_empty() {
                let n = me.out.len().min(buf.remaining());
                buf.put_slice(&me.out[..n]);
                me.out.advance(n);
                return Poll::Ready(Ok(()));
            }
            if me.eof {
                // A truncated frame goes on as it is: the server reports the broken connection.
                if !me.raw.is_empty() {
                    me.out = me.raw.split();
                    continue;
                }
                return Poll::Ready(Ok(()));
            }
            let mut scratch = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut scratch);
            ready!(Pin::new(&mut me.inner).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                me.eof = true;
                continue;
            }
            me.raw.extend_from_slice(rb.filled());
            me.rw.process(&mut me.raw, &mut me.out)?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for NormalisedStream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for NormalisedStream<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// The connections of a Unix listener, each behind [`NormalisedStream`]: what every
/// Unix-socket gRPC server of nodeplane serves (`serve_with_incoming*`).
pub fn incoming(
    listener: tokio::net::UnixListener,
) -> impl tokio_stream::Stream<Item = io::Result<NormalisedStream<tokio::net::UnixStream>>> + Send + 'static {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::UnixListenerStream::new(listener).map(|c| c.map(NormalisedStream::new))
}

/// A client connection that sends the `:authority` of [`Policy::Set`] on every request,
/// whatever tonic put there.
struct SetAuthority<S> {
    inner: S,
    rw: Rewriter,
    pending_in: BytesMut,
    pending_out: BytesMut,
}

impl<S: AsyncWrite + Unpin> SetAuthority<S> {
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.pending_out.is_empty() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending_out))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pending_out.advance(n);
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SetAuthority<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SetAuthority<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        ready!(me.drain(cx))?;
        me.pending_in.extend_from_slice(buf);
        me.rw.process(&mut me.pending_in, &mut me.pending_out)?;
        // Best effort now; what is left goes out on the next write or flush.
        if let Poll::Ready(Err(e)) = me.drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.drain(cx))?;
        Pin::new(&mut me.inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        ready!(me.drain(cx))?;
        Pin::new(&mut me.inner).poll_shutdown(cx)
    }
}

/// The authority grpc-go (kubelet's plugin watcher) sends for `unix:///path`: the path,
/// every byte outside RFC 3986's unreserved set percent-encoded.
pub fn percent_encoded_path(path: &Path) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = Vec::new();
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b);
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
    out
}

/// A gRPC channel over the Unix socket at `path` whose requests carry exactly `authority`
/// as `:authority` (`None`: no `:authority` at all) — to dial as kubelet, grpcio or another
/// client does, which tonic's own client cannot. For tests and emulators.
pub async fn connect_unix_with_authority(
    path: &Path,
    authority: Option<Vec<u8>>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = Arc::new(path.to_path_buf());
    tonic::transport::Endpoint::from_static("http://unix.invalid")
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect_with_connector(tower::service_fn(move |_| {
            let (path, authority) = (path.clone(), authority.clone());
            async move {
                let s = tokio::net::UnixStream::connect(&*path).await?;
                let s = SetAuthority {
                    inner: s,
                    rw: Rewriter::new(Policy::Set(authority)),
                    pending_in: BytesMut::new(),
                    pending_out: BytesMut::new(),
                };
                Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, sid: u32, payload: &[u8]) -> Vec<u8> {
        let l = payload.len();
        let mut f = vec![(l >> 16) as u8, (l >> 8) as u8, l as u8, kind, flags];
        f.extend_from_slice(&sid.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Cut a byte stream (after the preface) into (type, flags, stream, payload).
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            let l = (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]);
            v.push((b[3], b[4], u32::from_be_bytes([b[5], b[6], b[7], b[8]]), b[9..9 + l].to_vec()));
            b = &b[9 + l..];
        }
        v
    }

    fn request_headers(authority: &[u8]) -> Vec<(&'static [u8], Vec<u8>)> {
        vec![
            (b":method", b"POST".to_vec()),
            (b":scheme", b"http".to_vec()),
            (b":path", b"/pluginregistration.Registration/GetInfo".to_vec()),
            (b":authority", authority.to_vec()),
            (b"content-type", b"application/grpc".to_vec()),
            (b"te", b"trailers".to_vec()),
        ]
    }

    /// Run `input` through a rewriter in pieces of `chunk` bytes; decode what came out with
    /// an independent HPACK decoder.
    #[allow(clippy::type_complexity)] // raw bytes, header lists, frames
    fn run(
        policy: Policy,
        input: &[u8],
        chunk: usize,
    ) -> (Vec<u8>, Vec<Vec<(Vec<u8>, Vec<u8>)>>, Vec<(u8, u8, u32, Vec<u8>)>) {
        let mut rw = Rewriter::new(policy);
        let (mut buf, mut out) = (BytesMut::new(), BytesMut::new());
        for c in input.chunks(chunk.max(1)) {
            buf.extend_from_slice(c);
            rw.process(&mut buf, &mut out).unwrap();
        }
        assert!(buf.is_empty(), "everything decided");
        assert_eq!(&out[..PREFACE_LEN], PREFACE);
        let fr = frames(&out[PREFACE_LEN..]);
        let mut dec = loona_hpack::Decoder::new();
        let mut blocks = Vec::new();
        let mut cur = Vec::new();
        for (t, f, _, p) in &fr {
            if *t == TYPE_HEADERS || *t == TYPE_CONTINUATION {
                let mut p = &p[..];
                if *t == TYPE_HEADERS && f & FLAG_PRIORITY != 0 {
                    p = &p[5..];
                }
                cur.extend_from_slice(p);
                if f & FLAG_END_HEADERS != 0 {
                    blocks.push(dec.decode(&cur).unwrap());
                    cur.clear();
                }
            }
        }
        (out.to_vec(), blocks, fr)
    }

    fn authority_of(block: &[(Vec<u8>, Vec<u8>)]) -> Option<Vec<u8>> {
        block.iter().find(|(n, _)| n == b":authority").map(|(_, v)| v.clone())
    }

    /// A connection as tonic/grpc-go would write it: preface, SETTINGS, then requests whose
    /// header blocks use Huffman coding and the dynamic table (the second request refers to
    /// entries the first one added).
    fn client_stream(authority: &[u8]) -> Vec<u8> {
        let mut enc = loona_hpack::Encoder::new();
        let mut s = PREFACE.to_vec();
        s.extend(frame(0x4, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]));
        let h = request_headers(authority);
        let refs: Vec<(&[u8], &[u8])> = h.iter().map(|(n, v)| (*n, &v[..])).collect();
        let b1 = enc.encode(refs.iter().copied());
        s.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &b1));
        s.extend(frame(0x0, FLAG_END_STREAM, 1, &[0, 0, 0, 0, 0]));
        let b2 = enc.encode(refs.iter().copied());
        assert!(b2.len() < b1.len(), "the second block uses the dynamic table");
        s.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &b2));
        s.extend(frame(0x0, FLAG_END_STREAM, 3, &[0, 0, 0, 0, 0]));
        s
    }

    #[test]
    fn percent_encoded_and_raw_paths_become_localhost() {
        let sock = Path::new("/var/lib/kubelet/plugins_registry/csi.nodeplane.dev-reg.sock");
        for auth in
            [percent_encoded_path(sock), sock.to_string_lossy().as_bytes().to_vec(), b"tmp%2Fa%20b.sock".to_vec()]
        {
            assert!(!valid_authority(&auth), "{auth:?}");
            for chunk in [1, 7, 4096] {
                let (_, blocks, fr) = run(Policy::Normalise, &client_stream(&auth), chunk);
                assert_eq!(blocks.len(), 2);
                for b in &blocks {
                    assert_eq!(authority_of(b).as_deref(), Some(LOCALHOST));
                    // Every other field arrives unchanged, in order.
                    let want: Vec<_> = request_headers(LOCALHOST).into_iter().map(|(n, v)| (n.to_vec(), v)).collect();
                    assert_eq!(b, &want);
                }
                // SETTINGS and DATA frames pass through untouched.
                assert_eq!(fr[0], (0x4, 0, 0, vec![0, 4, 0, 0, 0xff, 0xff]));
                assert_eq!(fr.iter().filter(|f| f.0 == 0).count(), 2);
            }
        }
    }

    #[test]
    fn valid_authorities_are_kept() {
        for auth in [&b"localhost"[..], b"unix.invalid", b"127.0.0.1:9640", b"[::1]:80", b"node-1.example:443"] {
            let (_, blocks, _) = run(Policy::Normalise, &client_stream(auth), 3);
            assert!(blocks.iter().all(|b| authority_of(b).as_deref() == Some(auth)), "{auth:?}");
        }
    }

    #[test]
    fn absent_authority_stays_absent() {
        let mut enc = loona_hpack::Encoder::new();
        let mut s = PREFACE.to_vec();
        let b = enc.encode([(&b":method"[..], &b"POST"[..]), (b":path", b"/x/Y"), (b":scheme", b"http")]);
        s.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, &b));
        let (_, blocks, fr) = run(Policy::Normalise, &s, 5);
        assert_eq!(authority_of(&blocks[0]), None);
        assert_eq!(fr[0].1, FLAG_END_HEADERS | FLAG_END_STREAM);
    }

    #[test]
    fn continuation_padding_and_priority() {
        let mut enc = loona_hpack::Encoder::new();
        let long = vec![b'v'; 40_000];
        let auth = b"%2Fa%2Fb".to_vec();
        let block = enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":authority", &auth[..]),
            (b":path", b"/p/Q"),
            (b"x-big", &long[..]),
        ]);
        // HEADERS (padded, with priority) + two CONTINUATIONs.
        let (a, rest) = block.split_at(100);
        let (b, c) = rest.split_at(rest.len() / 2);
        let mut p = vec![3u8];
        p.extend_from_slice(&[0, 0, 0, 0, 7]);
        p.extend_from_slice(a);
        p.extend_from_slice(&[0, 0, 0]);
        let mut s = PREFACE.to_vec();
        s.extend(frame(TYPE_HEADERS, FLAG_PADDED | FLAG_PRIORITY | FLAG_END_STREAM, 5, &p));
        s.extend(frame(TYPE_CONTINUATION, 0, 5, b));
        s.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, c));
        let (_, blocks, fr) = run(Policy::Normalise, &s, 1000);
        assert_eq!(blocks.len(), 1);
        assert_eq!(authority_of(&blocks[0]).as_deref(), Some(LOCALHOST));
        assert_eq!(blocks[0][3], (b"x-big".to_vec(), long));
        // Re-framed: first HEADERS keeps priority and END_STREAM, no padding; every frame
        // fits the minimum max frame size; only the last ends the headers.
        assert_eq!(fr[0].0, TYPE_HEADERS);
        assert_eq!(fr[0].1, FLAG_PRIORITY | FLAG_END_STREAM);
        assert_eq!(&fr[0].3[..5], &[0, 0, 0, 0, 7]);
        assert!(fr.iter().all(|f| f.3.len() <= OUT_FRAME_MAX && f.2 == 5));
        assert!(fr[1..].iter().all(|f| f.0 == TYPE_CONTINUATION));
        assert_eq!(fr.iter().filter(|f| f.1 & FLAG_END_HEADERS != 0).count(), 1);
        assert_eq!(fr.last().unwrap().1, FLAG_END_HEADERS);
    }

    #[test]
    fn set_policy_sends_what_kubelet_sends() {
        let sock = Path::new("/var/lib/kubelet/plugins_registry/x-reg.sock");
        let enc = percent_encoded_path(sock);
        assert_eq!(enc, b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx-reg.sock");
        let (_, blocks, _) = run(Policy::Set(Some(enc.clone())), &client_stream(b"unix.invalid"), 11);
        assert!(blocks.iter().all(|b| authority_of(b) == Some(enc.clone()) && b[0].0 == b":authority"));
        let (_, blocks, _) = run(Policy::Set(None), &client_stream(b"unix.invalid"), 11);
        assert!(blocks.iter().all(|b| authority_of(b).is_none() && b.len() == 5));
    }

    /// What the rewriter answers to a connection of these frames after the preface.
    fn refusal(frames: &[Vec<u8>]) -> RewriteError {
        let mut s = PREFACE.to_vec();
        frames.iter().for_each(|f| s.extend_from_slice(f));
        let mut rw = Rewriter::new(Policy::Normalise);
        let (mut b, mut o) = (BytesMut::from(&s[..]), BytesMut::new());
        rw.process(&mut b, &mut o).expect_err("refused")
    }

    #[test]
    fn broken_streams_are_refused_not_passed() {
        let r = refusal(&[frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82])]);
        assert!(matches!(r, RewriteError::Protocol(_)), "{r}");
        // A header block interrupted by DATA, or continued on another stream.
        let r = refusal(&[frame(TYPE_HEADERS, 0, 1, &[0x82]), frame(0x0, 0, 1, &[1, 2])]);
        assert!(matches!(r, RewriteError::Protocol(_)), "{r}");
        let r = refusal(&[frame(TYPE_HEADERS, 0, 1, &[0x82]), frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 3, &[0x84])]);
        assert!(matches!(r, RewriteError::Protocol(_)), "{r}");
        // Padding longer than the frame.
        let r = refusal(&[frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_PADDED, 1, &[9, 0x82])]);
        assert!(matches!(r, RewriteError::Protocol(_)), "{r}");
        // Bad HPACK (index 0 is invalid), and a header frame over the limit (announced only).
        assert!(matches!(refusal(&[frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0x80])]), RewriteError::Hpack(_)));
        assert!(matches!(refusal(&[vec![0x20, 0, 0, TYPE_HEADERS, 0, 0, 0, 0, 1]]), RewriteError::TooLarge { .. }));
        // Indexed references that decode to more than MAX_DECODED.
        let mut enc = loona_hpack::Encoder::new();
        let v = vec![b'a'; 3000];
        let mut blk = enc.encode([(&b"x-a"[..], &v[..])]);
        blk.extend(std::iter::repeat_n(0xbe, 40)); // index 62: the entry just added
        assert!(matches!(refusal(&[frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &blk)]), RewriteError::TooLarge { .. }));
    }

    /// RFC 7541 C.4.1: a Huffman-coded request header block decodes, and a valid authority
    /// is kept.
    #[test]
    fn huffman_coded_blocks_decode() {
        let blk =
            [0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff];
        let mut s = PREFACE.to_vec();
        s.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, &blk));
        let (_, blocks, _) = run(Policy::Normalise, &s, 4);
        assert_eq!(authority_of(&blocks[0]).as_deref(), Some(&b"www.example.com"[..]));
        assert_eq!(blocks[0][0], (b":method".to_vec(), b"GET".to_vec()));
    }

    proptest::proptest! {
        /// Arbitrary bytes after the preface never panic the rewriter, in any chunking.
        #[test]
        fn arbitrary_input_never_panics(data in proptest::collection::vec(proptest::num::u8::ANY, 0..4096), chunk in 1usize..512) {
            let mut rw = Rewriter::new(Policy::Normalise);
            let (mut b, mut o) = (BytesMut::from(PREFACE), BytesMut::new());
            for c in data.chunks(chunk) {
                b.extend_from_slice(c);
                if rw.process(&mut b, &mut o).is_err() {
                    break;
                }
            }
        }
    }

    /// The async adapter over a real socket pair, read in small pieces: the same bytes come
    /// out as from the sans-IO rewriter.
    #[tokio::test]
    async fn stream_adapter_matches_the_rewriter() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let input = client_stream(b"%2Fvar%2Flib%2Fx.sock");
        let (want, _, _) = run(Policy::Normalise, &input, input.len());
        let (mut a, b) = tokio::net::UnixStream::pair().unwrap();
        let writer = tokio::spawn(async move {
            for c in input.chunks(13) {
                a.write_all(c).await.unwrap();
                tokio::task::yield_now().await;
            }
        });
        let mut s = NormalisedStream::new(b);
        let mut got = Vec::new();
        let mut buf = [0u8; 10];
        loop {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        writer.await.unwrap();
        assert_eq!(got, want);
    }
}
