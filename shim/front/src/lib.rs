//! The CNI shim's fast path, run before the C library starts.
//!
//! Every CNI call execs the shim, and a statically linked glibc program starts by asking
//! the CPU about its caches, several dozen `CPUID` instructions (`init_cacheinfo`). Each
//! one traps to the hypervisor on a virtual machine: on the test VM that is 7.6 us apiece,
//! 0.6 ms of a 0.8 ms exec, more than the agent's whole share of a CHECK. So the shim's
//! entry point is [`nodeplane_cni_entry`] (scripts/build-shim links it so), which runs
//! [`nodeplane_cni_front`] on raw system calls, without allocating: it reads stdin and the
//! environment, answers VERSION, or opens `CNI_NETNS`, sends the request (and the
//! namespace's descriptor) to the agent, prints its answer and exits. Anything unusual
//! (a command it does not know, a configuration it does not read plainly, no agent
//! listening, a namespace that does not open, a connection lost) makes it return: the
//! entry then starts the C library as usual and the full shim (`nodeplane_cni::shim`)
//! does everything again from the start, with the stdin the front read and, when the
//! front had reached the agent, how that went ([`handover`]): the full shim then carries on
//! as after its own first attempt.
//!
//! The front validates nothing the agent validates: the agent parses every request with
//! the same code the full shim uses and answers the same errors.
//!
//! Rules for code here (it runs with no C library, no thread-local storage, and, in a
//! static-pie binary, after relocating itself): nothing may panic or call a function
//! outside this crate (no `memcpy` either: `#![no_builtins]`, byte loops, `get` instead of
//! indexing). scripts/build-shim disassembles the linked shim and fails if the front
//! calls anything else.

#![no_std]
#![no_builtins]
// The front itself is x86-64 Linux only (elsewhere the binary starts at `_start` as usual).
#![cfg_attr(not(all(target_arch = "x86_64", target_os = "linux")), allow(dead_code))]

#[cfg(test)]
extern crate std;

pub mod json;

use core::cell::UnsafeCell;

/// Largest configuration read (the full shim's `MAX_CONFIG_BYTES`; one byte more tells it
/// was too big).
pub const MAX_CONFIG_BYTES: usize = 1 << 20;
/// Largest frame on the agent's socket (the full shim's `wire::MAX_FRAME`).
pub const MAX_FRAME: usize = 4 << 20;
/// Where the agent listens unless the configuration or `NODEPLANE_CNI_SOCKET` says otherwise.
pub const DEFAULT_SOCKET: &[u8] = b"/run/nodeplane/cni.sock";

/// The environment the front reads: the CNI variables it forwards, in the order the wire
/// request lists them (sorted), then the socket override.
const KEYS: [&[u8]; 7] = [
    b"CNI_ARGS",
    b"CNI_COMMAND",
    b"CNI_CONTAINERID",
    b"CNI_IFNAME",
    b"CNI_NETNS",
    b"CNI_PATH",
    b"NODEPLANE_CNI_SOCKET",
];
const COMMAND: usize = 1;
const NETNS: usize = 4;
const FORWARDED: usize = 6;
const SOCKET: usize = 6;

struct Shared<T>(UnsafeCell<T>);
// SAFETY: written by the front alone, before the C library (and any other thread) exists;
// read by the full shim's main afterwards, on the same thread.
unsafe impl<T> Sync for Shared<T> {}

static STDIN: Shared<[u8; MAX_CONFIG_BYTES + 1]> = Shared(UnsafeCell::new([0; MAX_CONFIG_BYTES + 1]));
static FRAME: Shared<[u8; 4 + MAX_FRAME]> = Shared(UnsafeCell::new([0; 4 + MAX_FRAME]));
static REPLY: Shared<[u8; MAX_FRAME]> = Shared(UnsafeCell::new([0; MAX_FRAME]));
static OUTPUT: Shared<[u8; MAX_FRAME + 1]> = Shared(UnsafeCell::new([0; MAX_FRAME + 1]));
static STATE: Shared<State> = Shared(UnsafeCell::new(State {
    stdin_taken: false,
    stdin_len: 0,
    stdin_errno: 0,
    failure: NO_FAILURE,
    errno: 0,
    len: 0,
    started_ns: 0,
}));

const NO_FAILURE: u8 = 0;
const LOST: u8 = 1;
const UNREAD_ANSWER: u8 = 2;
const OVERSIZE_ANSWER: u8 = 3;
const NOT_ACCEPTED: u8 = 4;

#[derive(Clone, Copy)]
struct State {
    stdin_taken: bool,
    stdin_len: usize,
    stdin_errno: i32,
    /// One of the failure kinds above; `errno` (0: the agent closed the connection) and
    /// `len` (the answer's length) go with them.
    failure: u8,
    errno: i32,
    len: usize,
    /// CLOCK_MONOTONIC when the front began, in nanoseconds.
    started_ns: u64,
}

/// How the exchange with the agent failed, when the front had connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The request was (being) sent, then the connection failed before a whole answer:
    /// the error's errno, `None` when the agent closed the connection.
    Lost(Option<i32>),
    /// A whole answer the front does not read plainly (the full shim decodes it).
    Answer(&'static [u8]),
    /// An answer whose header announces this many bytes, beyond the frame limit.
    OversizeAnswer(u32),
    /// The agent did not accept the connection within the send timeout.
    NotAccepted,
}

/// What the front leaves to the full shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handover {
    /// The stdin the front consumed (at most `MAX_CONFIG_BYTES + 1` bytes), or the error
    /// (errno) that ended reading it; `None`: stdin is untouched.
    pub stdin: Option<Result<&'static [u8], i32>>,
    /// How the exchange failed, if the front got that far.
    pub failure: Option<Failure>,
    /// CLOCK_MONOTONIC when the front began (nanoseconds), if it ran.
    pub started_ns: Option<u64>,
}

/// What the front did, for the full shim's `main` (nothing, unless the shim was entered
/// through `nodeplane_cni_entry`).
pub fn handover() -> Handover {
    // SAFETY: see `Shared`: nothing writes STATE or the buffers any more once main runs.
    let st = unsafe { *STATE.0.get() };
    let stdin = if !st.stdin_taken {
        None
    } else if st.stdin_errno != 0 {
        Some(Err(st.stdin_errno))
    } else {
        // SAFETY: as above; the bytes stay there for the life of the process.
        let all: &'static [u8; MAX_CONFIG_BYTES + 1] = unsafe { &*STDIN.0.get() };
        Some(Ok(all.get(..st.stdin_len).unwrap_or(&[])))
    };
    let failure = match st.failure {
        LOST => Some(Failure::Lost((st.errno != 0).then_some(st.errno))),
        UNREAD_ANSWER => {
            // SAFETY: as above.
            let all: &'static [u8; MAX_FRAME] = unsafe { &*REPLY.0.get() };
            Some(Failure::Answer(all.get(..st.len).unwrap_or(&[])))
        }
        OVERSIZE_ANSWER => Some(Failure::OversizeAnswer(st.len as u32)),
        NOT_ACCEPTED => Some(Failure::NotAccepted),
        _ => None,
    };
    Handover { stdin, failure, started_ns: (st.started_ns != 0).then_some(st.started_ns) }
}

/// The address of the entry point, for the binary to keep it linked.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub fn entry_address() -> usize {
    unsafe extern "C" {
        fn nodeplane_cni_entry();
    }
    nodeplane_cni_entry as *const () as usize
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod sys;

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub use sys::nodeplane_cni_front;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cmd {
    Add,
    Check,
    Del,
    Status,
    Gc,
    Version,
}

fn command(v: &[u8]) -> Option<Cmd> {
    Some(if json::eq(v, b"ADD") {
        Cmd::Add
    } else if json::eq(v, b"CHECK") {
        Cmd::Check
    } else if json::eq(v, b"DEL") {
        Cmd::Del
    } else if json::eq(v, b"STATUS") {
        Cmd::Status
    } else if json::eq(v, b"GC") {
        Cmd::Gc
    } else if json::eq(v, b"VERSION") {
        Cmd::Version
    } else {
        return None;
    })
}

/// How long the agent may take to answer (the full shim's `timeout_for`), in seconds.
fn answer_timeout(cmd: Cmd) -> i64 {
    match cmd {
        Cmd::Add => 90,
        Cmd::Status => 10,
        _ => 60,
    }
}

/// The environment variables of `KEYS` (first occurrence wins, as `getenv` finds them).
struct Env {
    values: [Option<&'static [u8]>; 7],
}
