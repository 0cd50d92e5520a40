//! The entry point, the system calls and the front itself (x86-64 Linux).

use core::arch::{asm, global_asm};

use super::json::{self, Field, Out};
use super::{
    Cmd, Env, FORWARDED, FRAME, KEYS, LOST, MAX_CONFIG_BYTES, MAX_FRAME, NETNS, NOT_ACCEPTED, OUTPUT, OVERSIZE_ANSWER,
    REPLY, SOCKET, STATE, STDIN, UNREAD_ANSWER,
};

// The process starts here (the kernel's stack: argc, argv, envp, auxv). Run the front on
// that stack; if it returns, restore the registers the C library's `_start` expects (the
// stack pointer and, under a dynamic loader, %rdx) and start the program as usual.
global_asm!(
    ".globl nodeplane_cni_entry",
    ".type nodeplane_cni_entry,@function",
    "nodeplane_cni_entry:",
    "mov rbx, rsp",
    "mov r12, rdx",
    "mov rdi, rsp",
    "and rsp, -16",
    "call {front}",
    "mov rsp, rbx",
    "mov rdx, r12",
    "jmp _start",
    ".size nodeplane_cni_entry, .-nodeplane_cni_entry",
    // In a static non-PIE binary there is no dynamic section: the reference stays 0.
    ".weak _DYNAMIC",
    front = sym nodeplane_cni_front,
);

const EINTR: isize = 4;
const EAGAIN: isize = 11;

#[inline(always)]
unsafe fn syscall(n: usize, a: usize, b: usize, c: usize, d: usize, e: usize, f: usize) -> isize {
    let r: isize;
    // SAFETY: the caller passes arguments valid for system call `n`.
    unsafe {
        asm!("syscall", inlateout("rax") n as isize => r, in("rdi") a, in("rsi") b, in("rdx") c,
             in("r10") d, in("r8") e, in("r9") f, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    r
}

const SYS_READ: usize = 0;
const SYS_WRITE: usize = 1;
const SYS_CLOSE: usize = 3;
const SYS_RT_SIGACTION: usize = 13;
const SYS_IOCTL: usize = 16;
const SYS_SOCKET: usize = 41;
const SYS_CONNECT: usize = 42;
const SYS_RECVFROM: usize = 45;
const SYS_SENDMSG: usize = 46;
const SYS_SETSOCKOPT: usize = 54;
const SYS_FSTATFS: usize = 138;
const SYS_CLOCK_GETTIME: usize = 228;
const SYS_EXIT_GROUP: usize = 231;
const SYS_OPENAT: usize = 257;

fn close(fd: i32) {
    // SAFETY: closing a descriptor this code opened.
    unsafe { syscall(SYS_CLOSE, fd as usize, 0, 0, 0, 0, 0) };
}

fn exit(code: i32) -> ! {
    loop {
        // SAFETY: ends the process.
        unsafe { syscall(SYS_EXIT_GROUP, code as usize, 0, 0, 0, 0, 0) };
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the clock `Instant` reads).
fn now_ns() -> u64 {
    const CLOCK_MONOTONIC: usize = 1;
    let mut ts = [0i64; 2];
    // SAFETY: a struct timespec to fill.
    let r = unsafe { syscall(SYS_CLOCK_GETTIME, CLOCK_MONOTONIC, ts.as_mut_ptr() as usize, 0, 0, 0, 0) };
    let [sec, nsec] = ts;
    if r != 0 { 0 } else { (sec as u64).wrapping_mul(1_000_000_000).wrapping_add(nsec as u64) }
}

/// Write all of `b` to `fd` (errors end it: the reader went away, as the full shim ignores).
fn write_all(fd: i32, mut b: &[u8]) {
    while !b.is_empty() {
        // SAFETY: `b` is valid for reading its length.
        let r = unsafe { syscall(SYS_WRITE, fd as usize, b.as_ptr() as usize, b.len(), 0, 0, 0) };
        if r == -EINTR {
            continue;
        }
        if r <= 0 {
            return;
        }
        b = b.get(r as usize..).unwrap_or(&[]);
    }
}

/// Apply the binary's own relative relocations (a static-pie binary is loaded anywhere and
/// relocates itself in the C library's start-up, which has not run yet). The C library
/// applies them again later: `base + addend` each time, the same value. False when the
/// binary's relocations are in a form this does not apply (the front then stays out).
///
/// # Safety
/// Only at process entry, before anything reads relocated data.
unsafe fn self_relocate() -> bool {
    let (base, dynamic): (usize, usize);
    // SAFETY: address computations only.
    unsafe {
        asm!("lea {b}, [rip + __ehdr_start]", "lea {d}, [rip + _DYNAMIC]", b = out(reg) base, d = out(reg) dynamic,
             options(nomem, nostack, preserves_flags));
    }
    if dynamic == 0 {
        return true; // not position-independent: nothing to relocate
    }
    const DT_NULL: usize = 0;
    const DT_RELA: usize = 7;
    const DT_RELASZ: usize = 8;
    const DT_RELAENT: usize = 9;
    const DT_REL: usize = 17;
    const DT_RELR: usize = 36;
    const R_X86_64_RELATIVE: usize = 8;
    const R_X86_64_IRELATIVE: usize = 37;
    let (mut rela, mut relasz, mut relaent) = (0usize, 0usize, 24usize);
    let mut d = dynamic as *const [usize; 2];
    loop {
        // SAFETY: the dynamic section is an array of (tag, value) ended by DT_NULL.
        let [tag, val] = unsafe { d.read_volatile() };
        match tag {
            DT_NULL => break,
            DT_RELA => rela = val,
            DT_RELASZ => relasz = val,
            DT_RELAENT => relaent = val,
            DT_REL | DT_RELR => return false,
            _ => {}
        }
        // SAFETY: still within the dynamic section (not past DT_NULL).
        d = unsafe { d.add(1) };
    }
    if relaent < 24 {
        return false;
    }
    let mut off = 0;
    while off + 24 <= relasz {
        let r = base.wrapping_add(rela).wrapping_add(off) as *const [usize; 3];
        // SAFETY: an entry of the binary's RELA table.
        let [offset, info, addend] = unsafe { r.read_volatile() };
        match info & 0xffff_ffff {
            R_X86_64_RELATIVE => {
                // SAFETY: the relocation's target, in the binary's writable segments.
                unsafe { (base.wrapping_add(offset) as *mut usize).write_volatile(base.wrapping_add(addend)) };
            }
            // Resolved by the C library later (memcpy and friends): the front never calls them.
            R_X86_64_IRELATIVE => {}
            _ => return false,
        }
        off += relaent;
    }
    true
}

/// SIGPIPE ignored, as the Rust runtime has it (a reader that went away is an error, not
/// a death).
fn ignore_sigpipe() {
    const SIGPIPE: usize = 13;
    // struct kernel_sigaction: handler (SIG_IGN = 1), flags, restorer, mask.
    let act: [usize; 4] = [1, 0, 0, 0];
    // SAFETY: a valid sigaction for SIGPIPE, the kernel's sigset size.
    unsafe { syscall(SYS_RT_SIGACTION, SIGPIPE, act.as_ptr() as usize, 0, 8, 0, 0) };
}

/// The value of `NAME=value` if `entry` (a C string) is that variable.
///
/// # Safety
/// `entry` is a NUL-terminated string that lives as long as the process.
unsafe fn value_of(entry: *const u8, name: &[u8]) -> Option<&'static [u8]> {
    let mut i = 0;
    while i < name.len() {
        // SAFETY: within the C string (we stop at its NUL: a name has none).
        if unsafe { *entry.add(i) } != *name.get(i)? {
            return None;
        }
        i += 1;
    }
    // SAFETY: as above.
    if unsafe { *entry.add(i) } != b'=' {
        return None;
    }
    // SAFETY: the value runs from after '=' to the NUL.
    let start = unsafe { entry.add(i + 1) };
    let mut n = 0;
    while unsafe { *start.add(n) } != 0 {
        n += 1;
    }
    // SAFETY: `n` bytes before the NUL, in the process's environment block.
    Some(unsafe { core::slice::from_raw_parts(start, n) })
}

impl Env {
    /// # Safety
    /// `envp` is the process's environment array (NULL-terminated C strings).
    unsafe fn collect(mut envp: *const *const u8) -> Env {
        let mut env = Env { values: [None; 7] };
        loop {
            // SAFETY: envp is NULL-terminated.
            let entry = unsafe { *envp };
            if entry.is_null() {
                return env;
            }
            for (k, slot) in KEYS.iter().zip(env.values.iter_mut()) {
                if slot.is_none() {
                    // SAFETY: an environment entry.
                    if let Some(v) = unsafe { value_of(entry, k) } {
                        *slot = Some(v);
                    }
                }
            }
            // SAFETY: not past the NULL.
            envp = unsafe { envp.add(1) };
        }
    }

    fn get(&self, i: usize) -> Option<&'static [u8]> {
        self.values.get(i).copied().flatten()
    }
}

enum Stdin {
    Read(&'static [u8]),
    /// Nothing read: the full shim reads it.
    Untouched,
    /// Read in part, then an error.
    Failed,
}

fn read_stdin() -> Stdin {
    // SAFETY: the front is the only code running (see `Shared`).
    let buf: &'static mut [u8; MAX_CONFIG_BYTES + 1] = unsafe { &mut *STDIN.0.get() };
    let st = unsafe { &mut *STATE.0.get() };
    let mut len = 0;
    while len < buf.len() {
        let Some(rest) = buf.get_mut(len..) else { break };
        // SAFETY: `rest` is writable for its length.
        let r = unsafe { syscall(SYS_READ, 0, rest.as_mut_ptr() as usize, rest.len(), 0, 0, 0) };
        if r == -EINTR {
            continue;
        }
        if r < 0 {
            if len == 0 {
                return Stdin::Untouched;
            }
            st.stdin_taken = true;
            st.stdin_errno = -r as i32;
            return Stdin::Failed;
        }
        if r == 0 {
            break;
        }
        len += r as usize;
    }
    st.stdin_taken = true;
    st.stdin_len = len;
    Stdin::Read(buf.get(..len).unwrap_or(&[]))
}

/// Open `path` (a C string from the environment) and check it is a network namespace, as
/// `nsfs::open_netns` does.
fn open_netns(path: &'static [u8]) -> Option<i32> {
    const AT_FDCWD: isize = -100;
    const O_RDONLY_CLOEXEC: usize = 0o2000000;
    const NSFS_MAGIC: usize = 0x6e73_6673;
    const NS_GET_NSTYPE: usize = 0xb703;
    const CLONE_NEWNET: isize = 0x4000_0000;
    // SAFETY: `path` is followed by its NUL in the environment block.
    let fd = unsafe { syscall(SYS_OPENAT, AT_FDCWD as usize, path.as_ptr() as usize, O_RDONLY_CLOEXEC, 0, 0, 0) };
    if fd < 0 {
        return None;
    }
    let fd = fd as i32;
    let mut st = [0usize; 15]; // struct statfs: f_type first
    // SAFETY: a buffer the size of struct statfs.
    let r = unsafe { syscall(SYS_FSTATFS, fd as usize, st.as_mut_ptr() as usize, 0, 0, 0, 0) };
    // SAFETY: NS_GET_NSTYPE takes no argument.
    let ty = if r == 0 { unsafe { syscall(SYS_IOCTL, fd as usize, NS_GET_NSTYPE, 0, 0, 0, 0) } } else { 0 };
    if r != 0 || st.first().copied() != Some(NSFS_MAGIC) || (ty >= 0 && ty != CLONE_NEWNET) {
        close(fd);
        return None;
    }
    Some(fd)
}

enum Connect {
    Connected(i32),
    /// Not accepted within the send timeout (a listen queue that stays full).
    NotAccepted,
    /// Anything else: the full shim connects again, and waits for an agent as it does.
    Failed,
}

/// A connected stream socket to `path`, its timeouts set first (as the full shim sets them).
fn connect(path: &[u8], answer_secs: i64) -> Connect {
    const AF_UNIX: usize = 1;
    const SOCK_STREAM_CLOEXEC: usize = 1 | 0o2000000;
    const SOL_SOCKET: usize = 1;
    const SO_RCVTIMEO: usize = 20;
    const SO_SNDTIMEO: usize = 21;
    let mut addr = [0u8; 110]; // sockaddr_un: family, then sun_path[108]
    if path.len() >= 108 {
        return Connect::Failed;
    }
    let mut i = 0;
    while i < path.len() {
        match (addr.get_mut(2 + i), path.get(i)) {
            (Some(d), Some(c)) => *d = *c,
            _ => return Connect::Failed,
        }
        i += 1;
    }
    if let Some(family) = addr.get_mut(0) {
        *family = AF_UNIX as u8;
    }
    // SAFETY: plain socket creation.
    let fd = unsafe { syscall(SYS_SOCKET, AF_UNIX, SOCK_STREAM_CLOEXEC, 0, 0, 0, 0) };
    if fd < 0 {
        return Connect::Failed;
    }
    let fd = fd as i32;
    let send: [i64; 2] = [10, 0];
    let answer: [i64; 2] = [answer_secs, 0];
    // SAFETY: struct timeval values of the right size, a socket we own.
    let ok = unsafe {
        syscall(SYS_SETSOCKOPT, fd as usize, SOL_SOCKET, SO_SNDTIMEO, send.as_ptr() as usize, 16, 0) == 0
            && syscall(SYS_SETSOCKOPT, fd as usize, SOL_SOCKET, SO_RCVTIMEO, answer.as_ptr() as usize, 16, 0) == 0
    };
    if !ok {
        close(fd);
        return Connect::Failed;
    }
    // SAFETY: a sockaddr_un of the given length.
    let r = unsafe { syscall(SYS_CONNECT, fd as usize, addr.as_ptr() as usize, 2 + path.len() + 1, 0, 0, 0) };
    if r != 0 {
        close(fd);
        return if r == -EAGAIN { Connect::NotAccepted } else { Connect::Failed };
    }
    Connect::Connected(fd)
}

enum Fail {
    /// The connection failed before a whole answer: errno, or `None` when the agent closed it.
    Lost(Option<i32>),
    /// The answer's header announces more than a frame may hold.
    Oversize(u32),
}

fn lost(r: isize) -> Fail {
    Fail::Lost(Some(-r as i32))
}

/// Send `frame` (with `netns` attached to its first bytes), read the answer's frame.
fn exchange(sock: i32, frame: &[u8], netns: Option<i32>) -> Result<&'static [u8], Fail> {
    const MSG_NOSIGNAL: usize = 0x4000;
    let mut sent = 0;
    while sent < frame.len() {
        let rest = frame.get(sent..).unwrap_or(&[]);
        let iov: [usize; 2] = [rest.as_ptr() as usize, rest.len()];
        // struct cmsghdr (len, level SOL_SOCKET | type SCM_RIGHTS << 32) and the descriptor.
        let cmsg: [u64; 3] = [20, 1 | (1 << 32), netns.unwrap_or(0) as u64];
        let (control, control_len) = match netns {
            Some(_) if sent == 0 => (cmsg.as_ptr() as usize, 24),
            _ => (0, 0),
        };
        // struct msghdr: name, namelen, iov, iovlen, control, controllen, flags.
        let msg: [usize; 7] = [0, 0, iov.as_ptr() as usize, 1, control, control_len, 0];
        // SAFETY: the message and everything it points to live across the call.
        let r = unsafe { syscall(SYS_SENDMSG, sock as usize, msg.as_ptr() as usize, MSG_NOSIGNAL, 0, 0, 0) };
        if r == -EINTR {
            continue;
        }
        if r <= 0 {
            return Err(if r == 0 { Fail::Lost(None) } else { lost(r) });
        }
        sent += r as usize;
    }
    let mut header = [0u8; 4];
    recv_exact(sock, &mut header)?;
    let announced = u32::from_be_bytes(header);
    let len = announced as usize;
    // SAFETY: see `Shared`.
    let reply: &'static mut [u8; MAX_FRAME] = unsafe { &mut *REPLY.0.get() };
    let body = match reply.get_mut(..len) {
        Some(body) if len <= MAX_FRAME => body,
        _ => return Err(Fail::Oversize(announced)),
    };
    recv_exact(sock, body)?;
    Ok(body)
}

fn recv_exact(sock: i32, buf: &mut [u8]) -> Result<(), Fail> {
    let mut got = 0;
    while got < buf.len() {
        let Some(rest) = buf.get_mut(got..) else { break };
        // SAFETY: `rest` is writable for its length.
        let r = unsafe { syscall(SYS_RECVFROM, sock as usize, rest.as_mut_ptr() as usize, rest.len(), 0, 0, 0) };
        if r == -EINTR {
            continue;
        }
        if r == 0 {
            return Err(Fail::Lost(None)); // the agent went away before answering
        }
        if r < 0 {
            return Err(lost(r));
        }
        got += r as usize;
    }
    Ok(())
}

/// The front (see the crate's documentation). Returns only to hand over to the full shim.
///
/// # Safety
/// Only from `nodeplane_cni_entry`, with the process's initial stack pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nodeplane_cni_front(sp: *const usize) {
    // SAFETY: at process entry.
    if !unsafe { self_relocate() } {
        return;
    }
    // SAFETY: see `Shared`.
    unsafe { (*STATE.0.get()).started_ns = now_ns() };
    ignore_sigpipe();
    // SAFETY: the initial stack: argc, argv[argc], NULL, envp..., NULL.
    let env = unsafe {
        let argc = *sp;
        Env::collect(sp.add(1 + argc + 1) as *const *const u8)
    };
    let Some(cmd) = env.get(super::COMMAND).and_then(super::command) else { return };
    let stdin = match read_stdin() {
        Stdin::Read(b) => b,
        Stdin::Untouched | Stdin::Failed => return,
    };
    if stdin.len() > MAX_CONFIG_BYTES {
        return;
    }
    let Some(conf) = json::scan_config(stdin) else { return };
    // SAFETY: see `Shared`.
    let output: &'static mut [u8; MAX_FRAME + 1] = unsafe { &mut *OUTPUT.0.get() };
    if cmd == Cmd::Version {
        let requested = match conf.cni_version {
            Field::Absent => None,
            Field::Plain(s, e) => stdin.get(s..e),
            Field::Other => return,
        };
        let mut out = Out::new(output);
        json::version_answer(requested, &mut out);
        out.byte(b'\n');
        write_all(1, out.written());
        exit(0);
    }
    // The full shim forwards only what is valid UTF-8 (it drops other values).
    if !env.values.iter().all(|v| match v {
        Some(b) => json::utf8_ok(b),
        None => true,
    }) {
        return;
    }
    let socket = match conf.agent_socket {
        Field::Plain(s, e) => match stdin.get(s..e) {
            Some(p) if p.first() == Some(&b'/') => p,
            _ => return,
        },
        Field::Other => return,
        Field::Absent => match env.get(SOCKET) {
            Some(p) if !p.is_empty() => p,
            Some(_) => return,
            None => super::DEFAULT_SOCKET,
        },
    };
    let netns = if matches!(cmd, Cmd::Add | Cmd::Check) {
        match env.get(NETNS) {
            Some(p) if p.first() == Some(&b'/') => match open_netns(p) {
                Some(fd) => Some(fd),
                None => return,
            },
            _ => return,
        }
    } else {
        None
    };
    // Hand over (closing what the front opened), with how the exchange failed, if it did.
    let done = |failure: u8, errno: i32, len: usize| {
        if let Some(fd) = netns {
            close(fd);
        }
        // SAFETY: see `Shared`.
        let st = unsafe { &mut *STATE.0.get() };
        st.failure = failure;
        st.errno = errno;
        st.len = len;
    };
    let mut pairs: [(&[u8], &[u8]); FORWARDED] = [(&[], &[]); FORWARDED];
    let mut n = 0;
    for (k, v) in KEYS.iter().zip(env.values.iter()).take(FORWARDED) {
        if let (Some(v), Some(slot)) = (v, pairs.get_mut(n)) {
            *slot = (k, v);
            n += 1;
        }
    }
    // SAFETY: see `Shared`.
    let frame_buf: &'static mut [u8; 4 + MAX_FRAME] = unsafe { &mut *FRAME.0.get() };
    let mut frame = Out::new(frame_buf);
    if json::encode_request(pairs.get(..n).unwrap_or(&[]), stdin, &mut frame).is_none() {
        return done(super::NO_FAILURE, 0, 0);
    }
    let sock = match connect(socket, super::answer_timeout(cmd)) {
        Connect::Connected(fd) => fd,
        Connect::NotAccepted => return done(NOT_ACCEPTED, 0, 0),
        Connect::Failed => return done(super::NO_FAILURE, 0, 0),
    };
    let body = exchange(sock, frame.written(), netns);
    close(sock);
    let body = match body {
        Ok(body) => body,
        Err(Fail::Lost(errno)) => return done(LOST, errno.unwrap_or(0), 0),
        Err(Fail::Oversize(len)) => return done(OVERSIZE_ANSWER, 0, len as usize),
    };
    let mut out = Out::new(output);
    let Some(code) = json::decode_reply(body, &mut out) else {
        // Not read plainly here: the full shim decodes it as it decodes every answer.
        return done(UNREAD_ANSWER, 0, body.len());
    };
    if !out.is_empty() {
        out.byte(b'\n');
    }
    write_all(1, out.written());
    exit(code);
}
