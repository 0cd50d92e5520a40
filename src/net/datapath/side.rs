//! A helper thread for work that can overlap the request's own: an ADD hands it the lease
//! file's write and the opening of the pod namespace's link socket, and creates the veth
//! pair meanwhile (the kernel's longest step). The two are independent and the second CPU
//! is otherwise idle while one ADD runs, so the ADD waits for the longer of the two only.
//!
//! One thread, one job at a time: when it is busy (parallel ADDs), [`Side::run`] runs the
//! job on the caller's thread, so parallel requests never queue behind each other here.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};

type Job = Box<dyn FnOnce() + Send>;

pub struct Side {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    job: Option<Job>,
    busy: bool,
    closed: bool,
    /// No thread (it could not be started): every job runs on its caller.
    absent: bool,
}

/// A job's result, to be waited for.
pub enum Pending<T> {
    Done(T),
    Away(Arc<(Mutex<Option<std::thread::Result<T>>>, Condvar)>),
}

impl<T> Pending<T> {
    /// The job's result (its panic goes on in the caller).
    pub fn wait(self) -> T {
        match self {
            Pending::Done(t) => t,
            Pending::Away(slot) => {
                let mut r = slot.0.lock().unwrap();
                loop {
                    if let Some(done) = r.take() {
                        return done.unwrap_or_else(|p| std::panic::resume_unwind(p));
                    }
                    r = slot.1.wait(r).unwrap();
                }
            }
        }
    }
}

impl Side {
    pub fn start(name: &str) -> Side {
        let shared = Arc::new(Shared::default());
        let me = shared.clone();
        if let Err(e) = std::thread::Builder::new().name(name.into()).spawn(move || work(&me)) {
            tracing::warn!(error = %e, "starting the {name} thread: its work runs on the request's thread");
            shared.state.lock().unwrap().absent = true;
        }
        Side { shared }
    }

    /// Run `job` on the helper thread if it is free, else here and now.
    pub fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Pending<T> {
        let mut st = self.shared.state.lock().unwrap();
        if st.busy || st.job.is_some() || st.absent || st.closed {
            drop(st);
            return Pending::Done(job());
        }
        let slot = Arc::new((Mutex::new(None), Condvar::new()));
        let out = slot.clone();
        st.job = Some(Box::new(move || {
            let r = catch_unwind(AssertUnwindSafe(job));
            *out.0.lock().unwrap() = Some(r);
            out.1.notify_one();
        }));
        drop(st);
        self.shared.wake.notify_one();
        Pending::Away(slot)
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap().closed = true;
        self.shared.wake.notify_one();
    }
}

fn work(shared: &Shared) {
    let mut st = shared.state.lock().unwrap();
    loop {
        if let Some(job) = st.job.take() {
            st.busy = true;
            drop(st);
            job();
            st = shared.state.lock().unwrap();
            st.busy = false;
            continue;
        }
        if st.closed {
            return;
        }
        st = shared.wake.wait(st).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_job_runs_on_the_helper_while_the_caller_works_and_a_second_runs_inline() {
        let side = Side::start("side-test");
        let caller = std::thread::current().id();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let first = side.run(move || {
            rx.recv().unwrap();
            std::thread::current().id()
        });
        // The helper is busy with the first job: the second runs here, at once.
        let second = side.run(move || std::thread::current().id());
        assert!(matches!(second, Pending::Done(_)));
        assert_eq!(second.wait(), caller);
        tx.send(()).unwrap();
        assert_ne!(first.wait(), caller);
        // Free again once the first is done.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let p = side.run(|| std::thread::current().id());
            let away = matches!(p, Pending::Away(_));
            let id = p.wait();
            if away {
                assert_ne!(id, caller);
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the helper never became free");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_panic_on_the_helper_reaches_the_caller_and_the_helper_goes_on() {
        let side = Side::start("side-test");
        let p = side.run(|| -> u32 { panic!("boom") });
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| p.wait()));
        assert!(r.is_err());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let p = side.run(|| 7);
            let away = matches!(p, Pending::Away(_));
            assert_eq!(p.wait(), 7);
            if away {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the helper never became free");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
