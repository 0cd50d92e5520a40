//! A loopback TCP proxy in front of a real server, for network faults. `cut()` closes every
//! open connection and refuses new ones (accepted and closed at once) until `restore()`: a
//! server that cannot be reached. `hold()` closes every open connection and lets new ones
//! wait, unanswered, until `restore()` forwards them: a partition while the client keeps
//! trying (its connection attempts are not failures it backs off from). The proxy forwards
//! bytes and nothing else (TLS passes through untouched): the answers are the server's own.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub struct FaultProxy {
    port: u16,
    st: Arc<State>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    Hold,
    Cut,
}

struct State {
    upstream: u16,
    mode: Mutex<Mode>,
    /// Connections accepted while held, forwarded on `restore`.
    held: Mutex<Vec<TcpStream>>,
    stopped: AtomicBool,
    /// Open connections (both sockets of each), to close on `cut`.
    open: Mutex<HashMap<u64, (TcpStream, TcpStream)>>,
    next: AtomicU64,
}

impl FaultProxy {
    /// Listens on a free loopback port, forwarding to `127.0.0.1:upstream`.
    pub fn start(upstream: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let st = Arc::new(State {
            upstream,
            mode: Mutex::new(Mode::Pass),
            held: Mutex::new(Vec::new()),
            stopped: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        });
        let s = st.clone();
        std::thread::Builder::new().name(format!("proxy-{port}")).spawn(move || accept(listener, s)).unwrap();
        FaultProxy { port, st }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server becomes unreachable: open connections are closed, new ones closed at once.
    pub fn cut(&self) {
        self.set(Mode::Cut);
        self.st.held.lock().unwrap().clear();
    }

    /// Open connections are closed; new ones wait until `restore`.
    pub fn hold(&self) {
        self.set(Mode::Hold);
    }

    /// Everything is forwarded again, the connections held meanwhile first.
    pub fn restore(&self) {
        *self.st.mode.lock().unwrap() = Mode::Pass;
        for client in self.st.held.lock().unwrap().drain(..) {
            forward(client, &self.st);
        }
    }

    fn set(&self, mode: Mode) {
        *self.st.mode.lock().unwrap() = mode;
        for (_, (a, b)) in self.st.open.lock().unwrap().drain() {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.st.stopped.store(true, Ordering::SeqCst);
        self.cut();
        // Wakes the accepting thread, which then sees `stopped`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn accept(listener: TcpListener, st: Arc<State>) {
    for client in listener.incoming() {
        if st.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        // (Under the lock: a `restore` between the check and the push would strand it.)
        let mode = st.mode.lock().unwrap();
        match *mode {
            Mode::Cut => {} // dropped: closed at once
            Mode::Hold => st.held.lock().unwrap().push(client),
            Mode::Pass => forward(client, &st),
        }
    }
}

/// Connects `client` to the server and copies both ways on two threads.
fn forward(client: TcpStream, st: &Arc<State>) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", st.upstream)) else { return };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let id = st.next.fetch_add(1, Ordering::SeqCst);
    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) =
        (client.try_clone(), server.try_clone(), client.try_clone(), server.try_clone())
    else {
        return;
    };
    st.open.lock().unwrap().insert(id, (c2, s2));
    let s = st.clone();
    std::thread::spawn(move || pump(client, server, id, s));
    let s = st.clone();
    std::thread::spawn(move || pump(s3, c3, id, s));
}

/// Copies `from` to `to` until either ends, then closes both (and forgets the connection).
fn pump(mut from: TcpStream, mut to: TcpStream, id: u64, st: Arc<State>) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
    st.open.lock().unwrap().remove(&id);
}
