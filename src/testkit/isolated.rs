//! An instance whose runtime is a thread of its own: it can stall (none of its tasks
//! runs, as in a long pause or CPU starvation) or die, while the checking runtime goes
//! on.

use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::runtime::Runtime;

/// Work for the isolated runtime's thread.
type Command = Box<dyn FnOnce(&Runtime) + Send>;

pub(super) struct Isolated {
    commands: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl Isolated {
    pub(super) fn start() -> Self {
        let (commands, received) = mpsc::channel::<Command>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime");
            for command in received {
                command(&runtime);
            }
            // The runtime dies here: its tasks (renewal, connections) are dropped.
            runtime.shutdown_background();
        });
        Isolated {
            commands: Some(commands),
            thread: Some(thread),
        }
    }

    /// Runs `work` on the isolated thread, with its runtime at hand, and waits for the
    /// result without blocking the caller's runtime.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Runtime) -> T + Send + 'static,
    ) -> T {
        let (done, result) = tokio::sync::oneshot::channel();
        let command: Command = Box::new(move |runtime| {
            let _ = done.send(work(runtime));
        });
        self.commands
            .as_ref()
            .expect("running")
            .send(command)
            .expect("the isolated thread runs");
        result.await.expect("the isolated work ran to its end")
    }

    /// Ends the thread and drops its runtime with every task on it: a crash.
    pub(super) fn kill(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        drop(self.commands.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        self.stop();
    }
}
