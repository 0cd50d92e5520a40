//! The CNI socket's accept loop: one thread blocks in accept(2) and starts a thread per
//! connection, which serves it start to end (50 ADDs at once are served at once). Stopping
//! shuts the listener for reading: connections already queued are still accepted and
//! served, then accept fails and the loop ends.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

type Serve = dyn Fn(UnixStream) + Send + Sync;

pub struct Acceptors {
    shared: Arc<Shared>,
}

struct Shared {
    listener: UnixListener,
    serve: Box<Serve>,
    runtime: Option<tokio::runtime::Handle>,
    /// Threads alive: the accept loop and one per connection being served.
    live: Mutex<usize>,
    ended: Condvar,
    stopping: AtomicBool,
}

impl Acceptors {
    /// Serve `listener` with `serve`, called once per connection on a thread of its own.
    /// Threads enter the current tokio runtime, if any, so the request path can reach it as
    /// it could from `spawn_blocking`.
    pub fn start(listener: UnixListener, serve: impl Fn(UnixStream) + Send + Sync + 'static) -> io::Result<Self> {
        listener.set_nonblocking(false)?;
        let shared = Arc::new(Shared {
            listener,
            serve: Box::new(serve),
            runtime: tokio::runtime::Handle::try_current().ok(),
            live: Mutex::new(1),
            ended: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let me = shared.clone();
        std::thread::Builder::new().name("cni-accept".into()).spawn(move || accept_loop(&me))?;
        Ok(Acceptors { shared })
    }

    /// No new connections: what is queued already is still served. Returns at once.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // SAFETY: shutdown(2) on the listener's descriptor, which `shared` owns and keeps
        // open; accept on a listening Unix socket shut for reading fails once its queue is
        // empty, which wakes the accept loop.
        if unsafe { libc::shutdown(self.shared.listener.as_raw_fd(), libc::SHUT_RD) } != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "shutting the CNI listener");
        }
    }

    /// After [`Acceptors::stop`]: wait until the loop has ended and every connection it
    /// accepted is served. False if some were still serving after `timeout`.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut live = self.shared.live.lock().unwrap();
        while *live > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            live = self.shared.ended.wait_timeout(live, left).unwrap().0;
        }
        true
    }
}

impl Drop for Acceptors {
    /// An agent leaving early (a start-up failure after the socket was served) stops
    /// accepting too; stopping twice is harmless.
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(shared: &Arc<Shared>) {
    loop {
        match shared.listener.accept() {
            Ok((stream, _)) => serve_on_a_thread(shared, stream),
            Err(_) if shared.stopping.load(Ordering::SeqCst) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // EMFILE, ENOMEM: the connection stays queued; try again shortly.
                tracing::warn!(error = %e, "accepting a CNI connection");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    shared.ended_one();
}

fn serve_on_a_thread(shared: &Arc<Shared>, stream: UnixStream) {
    *shared.live.lock().unwrap() += 1;
    let me = shared.clone();
    let spawned = std::thread::Builder::new().name("cni-conn".into()).spawn(move || {
        let _runtime = me.runtime.as_ref().map(|h| h.enter());
        (me.serve)(stream);
        me.ended_one();
    });
    if let Err(e) = spawned {
        // The stream is dropped with the closure: the shim sees the connection close and
        // tries again within its wait, as for an agent restart.
        tracing::warn!(error = %e, "starting a thread for a CNI connection");
        shared.ended_one();
    }
}

impl Shared {
    fn ended_one(&self) {
        let mut live = self.live.lock().unwrap();
        *live -= 1;
        if *live == 0 {
            self.ended.notify_all();
        }
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
    fn many_connections_at_once_are_served_at_once() {
        let (_d, path, l) = listener("acceptors-burst");
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let (i, m, g) = (inside.clone(), most.clone(), gate.clone());
        let acc = Acceptors::start(l, move |s| {
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
        acc.stop();
        assert!(acc.wait(Duration::from_secs(5)));
        assert_eq!(*acc.shared.live.lock().unwrap(), 0);
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
