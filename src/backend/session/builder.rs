//! What both session backends' builders do, written once: they change the backend's
//! state as configured so far, drop what was made from settings that changed, check the
//! shared settings, and keep the first setting refused, which `build` returns (and
//! `build_lazy` panics with).

use std::sync::Arc;
use std::time::Duration;

use super::Settings;
use crate::backend::SetupError;

/// A session backend's state, as its builder changes it.
pub(crate) trait Configurable {
    /// The settings both engines share.
    fn settings_mut(&mut self) -> &mut Settings;

    /// Drops what was made from the old settings, after any change.
    fn settings_changed(&mut self);
}

/// What a session backend's builder holds: the backend's state as configured so far,
/// and the first setting refused.
#[derive(Clone)]
pub(crate) struct Draft<I> {
    pub(crate) inner: I,
    refused: Option<String>,
}

impl<I> Draft<I> {
    pub(crate) fn new(inner: I) -> Self {
        Draft {
            inner,
            refused: None,
        }
    }

    /// The backend's state, to share, or the first setting refused, for `build`.
    pub(crate) fn finish(self) -> Result<Arc<I>, SetupError> {
        match self.refused {
            Some(problem) => Err(SetupError::Invalid(problem)),
            None => Ok(Arc::new(self.inner)),
        }
    }

    /// The backend's state, for a `build_lazy` of `builder`: a setting refused is a
    /// configuration mistake, not a server's state, so it panics.
    pub(crate) fn finish_lazy(self, builder: &str) -> Arc<I> {
        match self.refused {
            Some(problem) => panic!("{builder}: {problem}"),
            None => Arc::new(self.inner),
        }
    }
}

/// A session backend's builder, of the backend's state `I`: the shared setters' checks
/// run here, once.
pub(crate) trait Builder<I: Configurable>: Sized {
    /// The builder's state.
    fn draft(&mut self) -> &mut Draft<I>;

    /// Applies `change` to the backend's state (and drops whatever was made from the
    /// old settings).
    fn configure(mut self, change: impl FnOnce(&mut I)) -> Self {
        let inner = &mut self.draft().inner;
        change(inner);
        inner.settings_changed();
        self
    }

    /// Keeps the first refused setting for `build` to return.
    fn refuse(mut self, problem: String) -> Self {
        self.draft().refused.get_or_insert(problem);
        self
    }

    /// Sets the liveness interval; zero is refused.
    fn with_liveness_interval(self, interval: Duration) -> Self {
        if interval.is_zero() {
            return self.refuse("liveness_interval must not be zero".into());
        }
        self.configure(|inner| inner.settings_mut().timing.liveness_interval = interval)
    }

    /// Sets the command timeout; zero is refused.
    fn with_command_timeout(self, timeout: Duration) -> Self {
        if timeout.is_zero() {
            return self.refuse("command_timeout must not be zero".into());
        }
        self.configure(|inner| inner.settings_mut().timing.command_timeout = timeout)
    }

    /// Sets the prefix, as given.
    fn with_prefix(self, prefix: String) -> Self {
        self.configure(|inner| inner.settings_mut().prefix = prefix.into())
    }
}

/// Checks of a builder's refusals, for the engines' tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Builder, Configurable, SetupError};

    /// Asserts that `builder` refused the value `given`, naming `setting`.
    pub(crate) fn assert_refused<I: Configurable>(
        mut builder: impl Builder<I>,
        setting: &str,
        given: &str,
    ) {
        let refused = builder.draft().refused.take();
        assert!(
            refused.is_some_and(|problem| problem.contains(setting)),
            "{given:?} was accepted"
        );
    }

    /// Asserts that `build` returned a refused setting, which names `setting`, before
    /// it tried any connection.
    pub(crate) fn assert_invalid<T>(built: Result<T, SetupError>, setting: &str) {
        match built {
            Err(SetupError::Invalid(problem)) => {
                assert!(problem.contains(setting), "{problem}")
            }
            other => panic!("expected Invalid, got {:?}", other.map(|_| ())),
        }
    }
}
