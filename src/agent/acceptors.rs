//! The CNI socket's acceptors: threads that each block in accept(2) and serve the
//! connection they get, start to end, on the same thread.
//!
//! The shim's connect wakes one acceptor directly (the kernel wakes one waiter of a
//! listening socket per connection). Accepting on the async runtime instead cost two
//! wake-ups before any work: the runtime's I/O driver woke the task that accepts, which
//! handed the connection to a blocking thread; in `perf sched` traces of single ADDs that
//! was 0.15-0.2 ms between the shim's connect and the agent reading the request.
//!
//! The pool grows when a connection takes its last idle acceptor (50 ADDs at once get as
//! many threads, up to [`MAX_THREADS`]) and shrinks back to [`KEEP_IDLE`] idle threads
//! once they have waited [`LINGER`] with nothing to accept (so a burst of DELs after a
//! burst of ADDs finds its threads made). Stopping shuts the listener for reading:
//! connections already queued are still accepted and served, then each acceptor's accept
//! fails and it ends.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Threads serving or waiting at most; beyond, connections wait in the listen queue.
pub const MAX_THREADS: usize = 256;
/// Idle acceptors kept when requests finish.
pub const KEEP_IDLE: usize = 2;
/// How long an acceptor beyond [`KEEP_IDLE`] waits for a connection before it ends.
pub const LINGER: Duration = Duration::from_secs(10);

type Serve = dyn Fn(UnixStream) + Send + Sync;

pub struct Acceptors {
    shared: Arc<Shared>,
}

struct Shared {
    listener: UnixListener,
    serve: Box<Serve>,
    runtime: Option<tokio::runtime::Handle>,
    state: Mutex<State>,
    ended: Condvar,
    stopping: AtomicBool,
}

#[derive(Default)]
struct State {
    /// Threads alive (serving or waiting in accept).
    live: usize,
    /// Threads waiting in accept, or about to.
    idle: usize,
}

impl Acceptors {
    /// Serve `listener` with `serve`, called once per connection on the thread that
    /// accepted it. Threads enter the current tokio runtime, if any, so the request path
    /// can reach it as it could from `spawn_blocking`.
    pub fn start(listener: UnixListener, serve: impl Fn(UnixStream) + Send + Sync + 'static) -> io::Result<Self> {
        Self::start_with(listener, LINGER, serve)
    }

    fn start_with(
        listener: UnixListener,
        linger: Duration,
        serve: impl Fn(UnixStream) + Send + Sync + 'static,
    ) -> io::Result<Self> {
        listener.set_nonblocking(false)?;
        // accept(2) on a blocking socket honours its receive timeout: an idle acceptor
        // wakes up every `linger` to see whether it is one too many.
        let tv = libc::timeval {
            tv_sec: linger.as_secs() as libc::time_t,
            tv_usec: linger.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: setsockopt on the listener's open descriptor with a timeval of the right size.
        if unsafe {
            libc::setsockopt(
                listener.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        } != 0
        {
            return Err(io::Error::last_os_error());
        }
        let shared = Arc::new(Shared {
            listener,
            serve: Box::new(serve),
            runtime: tokio::runtime::Handle::try_current().ok(),
            state: Mutex::new(State::default()),
            ended: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        // Made first: if a thread cannot be started, dropping it stops the ones that were.
        let acceptors = Acceptors { shared };
        for _ in 0..KEEP_IDLE {
            let mut st = acceptors.shared.state.lock().unwrap();
            spawn(&acceptors.shared, &mut st)?;
        }
        Ok(acceptors)
    }

    /// No new connections: what is queued already is still served. Returns at once.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // SAFETY: shutdown(2) on the listener's descriptor, which `shared` owns and keeps
        // open; accept on a listening Unix socket shut for reading fails once its queue is
        // empty, which wakes every waiting acceptor.
        if unsafe { libc::shutdown(self.shared.listener.as_raw_fd(), libc::SHUT_RD) } != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "shutting the CNI listener");
        }
    }

    /// After [`Acceptors::stop`]: wait until every acceptor has served what it accepted
    /// and ended. False if some were still serving after `timeout`.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock().unwrap();
        while st.live > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self.shared.ended.wait_timeout(st, left).unwrap().0;
        }
        true
    }

    /// Threads alive (serving or waiting).
    #[cfg(test)]
    fn threads(&self) -> usize {
        self.shared.state.lock().unwrap().live
    }
}

impl Drop for Acceptors {
    /// An agent leaving early (a start-up failure after the socket was served) stops
    /// accepting too; stopping twice is harmless.
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start one more acceptor, counted idle from now (it is about to wait in accept).
fn spawn(shared: &Arc<Shared>, st: &mut State) -> io::Result<()> {
    let me = shared.clone();
    std::thread::Builder::new().name("cni-accept".into()).spawn(move || run(&me))?;
    st.live += 1;
    st.idle += 1;
    Ok(())
}

fn run(shared: &Arc<Shared>) {
    let _runtime = shared.runtime.as_ref().map(|h| h.enter());
    loop {
        let accepted = shared.listener.accept();
        let mut st = shared.state.lock().unwrap();
        st.idle -= 1;
        let stopping = shared.stopping.load(Ordering::SeqCst);
        match accepted {
            Ok((stream, _)) => {
                // Someone must be waiting for the next shim while this one is served.
                if st.idle == 0
                    && st.live < MAX_THREADS
                    && !stopping
                    && let Err(e) = spawn(shared, &mut st)
                {
                    tracing::warn!(error = %e, "starting a CNI acceptor");
                }
                drop(st);
                (shared.serve)(stream);
                st = shared.state.lock().unwrap();
            }
            Err(_) if stopping => break,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut => {
                // Nothing to accept for a while: one too many?
                if st.idle >= KEEP_IDLE {
                    break;
                }
            }
            Err(e) => {
                // EMFILE, ENOMEM: the connection stays queued; try again shortly.
                drop(st);
                tracing::warn!(error = %e, "accepting a CNI connection");
                std::thread::sleep(Duration::from_millis(20));
                st = shared.state.lock().unwrap();
            }
        }
        st.idle += 1;
    }
    let mut st = shared.state.lock().unwrap();
    st.live -= 1;
    if st.live == 0 {
        shared.ended.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::AtomicUsize;

    fn listener(tag: &str) -> (crate::util::TestDir, std::path::PathBuf, UnixListener) {
        let dir = crate::util::TestDir::new(tag);
        let path = dir.0.join("s.sock");
        let l = UnixListener::bind(&path).unwrap();
        (dir, path, l)
    }

    fn echo(mut s: UnixStream) {
        let mut b = [0u8; 1];
        if s.read_exact(&mut b).is_ok() {
            let _ = s.write_all(&b);
        }
    }

    #[test]
    fn many_connections_at_once_are_served_at_once_and_the_pool_shrinks_back() {
        let (_d, path, l) = listener("acceptors-burst");
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (i, m, g) = (inside.clone(), most.clone(), gate.clone());
        let acc = Acceptors::start_with(l, Duration::from_millis(100), move |s| {
            let now = i.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(now, Ordering::SeqCst);
            let mut open = g.0.lock().unwrap();
            while !*open {
                open = g.1.wait(open).unwrap();
            }
            drop(open);
            i.fetch_sub(1, Ordering::SeqCst);
            echo(s);
        })
        .unwrap();
        let clients: Vec<_> = (0..20u8)
            .map(|n| {
                let mut c = UnixStream::connect(&path).unwrap();
                c.write_all(&[n]).unwrap();
                (n, c)
            })
            .collect();
        // All 20 are inside the handler together: none waits for another to finish.
        let deadline = Instant::now() + Duration::from_secs(10);
        while inside.load(Ordering::SeqCst) < 20 {
            assert!(Instant::now() < deadline, "only {} served at once", inside.load(Ordering::SeqCst));
            std::thread::sleep(Duration::from_millis(5));
        }
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        for (n, mut c) in clients {
            let mut b = [0u8; 1];
            c.read_exact(&mut b).unwrap();
            assert_eq!(b[0], n);
        }
        assert_eq!(most.load(Ordering::SeqCst), 20);
        let deadline = Instant::now() + Duration::from_secs(10);
        while acc.threads() > KEEP_IDLE {
            assert!(Instant::now() < deadline, "{} threads left, {KEEP_IDLE} kept idle", acc.threads());
            std::thread::sleep(Duration::from_millis(5));
        }
        acc.stop();
        assert!(acc.wait(Duration::from_secs(5)));
        assert_eq!(acc.threads(), 0);
    }

    #[test]
    fn stopping_serves_what_is_queued_and_then_ends() {
        let (_d, path, l) = listener("acceptors-stop");
        let served = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (sv, g) = (served.clone(), gate.clone());
        let acc = Acceptors::start(l, move |s| {
            let mut open = g.0.lock().unwrap();
            while !*open {
                open = g.1.wait(open).unwrap();
            }
            drop(open);
            echo(s);
            sv.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let mut clients: Vec<_> = (0..5u8)
            .map(|n| {
                let mut c = UnixStream::connect(&path).unwrap();
                c.write_all(&[n]).unwrap();
                c
            })
            .collect();
        acc.stop();
        // Not done while requests are held inside the handler.
        assert!(!acc.wait(Duration::from_millis(100)));
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert!(acc.wait(Duration::from_secs(10)), "acceptors still alive after stop");
        assert_eq!(served.load(Ordering::SeqCst), 5);
        for (n, c) in clients.iter_mut().enumerate() {
            let mut b = [0u8; 1];
            c.read_exact(&mut b).unwrap();
            assert_eq!(b[0] as usize, n);
        }
    }
}
