//! Asking every master at once and counting the answers: the majority rule of
//! Redlock, for attempts, renewals and give-backs.

use std::future::Future;

use tokio::task::JoinSet;

use super::master::{Reply, Vote};

/// The masters that gave no answer and why, for errors: `host:port (cause)`, `; `
/// between them.
pub(super) fn failed_masters(failed: &[(String, String)]) -> String {
    failed
        .iter()
        .map(|(master, why)| format!("{master} ({why})"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The majority of `masters`: more than half.
pub(super) fn majority(masters: usize) -> usize {
    masters / 2 + 1
}

/// Sends `ask(i)` to every master `i` at once, each in a task of its own, and hands
/// the answers to `tally` as they come, until it returns `true` (decided) or every
/// master answered. Commands still out when the tally decides run on, unread: a write
/// already sent is not cut off halfway, and every write carries a token whose
/// give-back covers it. Dropping the future aborts the tasks still out.
pub(super) async fn ask_all<T, F, Fut>(masters: usize, ask: F, mut tally: impl FnMut(T) -> bool)
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let mut answers = JoinSet::new();
    for master in 0..masters {
        answers.spawn(ask(master));
    }
    while let Some(answer) = answers.join_next().await {
        // A task that panicked or was aborted answered nothing.
        let Ok(answer) = answer else { continue };
        if tally(answer) {
            answers.detach_all();
            return;
        }
    }
}

/// The votes of one acquire attempt, as they come.
#[derive(Debug, Default)]
pub(super) struct Votes {
    masters: usize,
    pub(super) granted: usize,
    pub(super) held: usize,
    /// Masters that did not answer, the refused among them.
    pub(super) no_answer: usize,
    refused: usize,
    /// Masters within their restart guard, and the shortest wait until one votes.
    pub(super) restarted: usize,
    pub(super) restart_wait_ms: Option<u64>,
    /// The shortest TTL left of another holder's key on a master (ms).
    pub(super) shortest_hold_ms: Option<u64>,
}

impl Votes {
    pub(super) fn new(masters: usize) -> Self {
        Votes {
            masters,
            ..Votes::default()
        }
    }

    /// Counts `vote`; whether the attempt is decided before every master answered:
    /// only when a majority granted. A failed attempt waits for the rest (at most the
    /// command timeout): it must know what to give back, and whether the key is busy
    /// or a majority is unreachable.
    pub(super) fn count(&mut self, vote: Vote) -> bool {
        match vote {
            Vote::Granted => self.granted += 1,
            Vote::Held { ttl_ms } => {
                self.held += 1;
                if let Ok(ttl) = u64::try_from(ttl_ms) {
                    self.shortest_hold_ms = Some(self.shortest_hold_ms.map_or(ttl, |s| s.min(ttl)));
                }
            }
            Vote::Restarted { wait_ms } => {
                self.restarted += 1;
                self.restart_wait_ms =
                    Some(self.restart_wait_ms.map_or(wait_ms, |w| w.min(wait_ms)));
            }
            Vote::NoAnswer => self.no_answer += 1,
            Vote::Refused => {
                self.no_answer += 1;
                self.refused += 1;
            }
        }
        self.won()
    }

    /// Whether a majority granted.
    pub(super) fn won(&self) -> bool {
        self.granted >= majority(self.masters)
    }

    /// Whether no master can hold the attempt's token: every one refused it, or
    /// refused the connection (the attempt never reached it). Nothing to give back.
    pub(super) fn nothing_granted(&self) -> bool {
        self.granted == 0 && self.no_answer == self.refused && self.outstanding() == 0
    }

    /// Whether too few masters answered for any majority: the lock service is down
    /// (for this instance), not busy.
    pub(super) fn unreachable(&self) -> bool {
        self.no_answer > self.masters - majority(self.masters)
    }

    /// Whether masters within their restart guard are what keeps a majority out of
    /// reach.
    pub(super) fn held_back_by_restarts(&self) -> bool {
        self.restarted > 0
            && self.masters - self.restarted - self.no_answer < majority(self.masters)
    }

    fn outstanding(&self) -> usize {
        self.masters - self.granted - self.held - self.no_answer - self.restarted
    }
}

/// The answers to a renewal or a give-back, as they come.
#[derive(Debug)]
pub(super) struct Replies {
    masters: usize,
    pub(super) ours: usize,
    pub(super) not_ours: usize,
    pub(super) no_answer: usize,
}

impl Replies {
    pub(super) fn new(masters: usize) -> Self {
        Replies {
            masters,
            ours: 0,
            not_ours: 0,
            no_answer: 0,
        }
    }

    /// Counts `reply`. A master that is down extends nothing and clears nothing, but
    /// is no reason to retry a give-back either (`no_answer` does not count it).
    pub(super) fn count(&mut self, reply: Reply) {
        match reply {
            Reply::Ours => self.ours += 1,
            Reply::NotOurs => self.not_ours += 1,
            Reply::NoAnswer => self.no_answer += 1,
            Reply::Down => {}
        }
    }

    /// Whether a majority said the token holds the key.
    pub(super) fn ours_on_a_majority(&self) -> bool {
        self.ours >= majority(self.masters)
    }

    /// Whether so many masters said "not ours" that no majority can hold the key for
    /// the token any more.
    pub(super) fn lost_on_a_majority(&self) -> bool {
        self.not_ours > self.masters - majority(self.masters)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_majority_is_more_than_half() {
        assert_eq!(majority(3), 2);
        assert_eq!(majority(4), 3);
        assert_eq!(majority(5), 3);
        assert_eq!(majority(7), 4);
    }

    #[test]
    fn only_a_majority_of_grants_decides_early() {
        let mut votes = Votes::new(5);
        assert!(!votes.count(Vote::Granted));
        assert!(!votes.count(Vote::Held { ttl_ms: 900 }));
        assert!(!votes.count(Vote::Granted));
        assert!(votes.count(Vote::Granted));
        assert!(votes.won());

        let mut votes = Votes::new(5);
        for _ in 0..3 {
            assert!(
                !votes.count(Vote::Held { ttl_ms: 300 }),
                "busy, but the rest may have granted"
            );
        }
        votes.count(Vote::NoAnswer);
        votes.count(Vote::Held { ttl_ms: 100 });
        assert!(!votes.won() && !votes.unreachable());
        assert_eq!(votes.shortest_hold_ms, Some(100));
    }

    #[test]
    fn a_majority_unanswered_is_unreachable() {
        let mut votes = Votes::new(5);
        votes.count(Vote::Held { ttl_ms: 300 });
        votes.count(Vote::Held { ttl_ms: 100 });
        votes.count(Vote::NoAnswer);
        votes.count(Vote::Refused);
        assert!(!votes.unreachable());
        votes.count(Vote::Refused);
        assert!(votes.unreachable() && !votes.held_back_by_restarts());
    }

    #[test]
    fn restarted_masters_do_not_vote() {
        let mut votes = Votes::new(3);
        votes.count(Vote::Granted);
        votes.count(Vote::Restarted { wait_ms: 700 });
        assert!(!votes.count(Vote::Restarted { wait_ms: 400 }));
        assert!(!votes.won() && votes.held_back_by_restarts() && !votes.unreachable());
        assert_eq!(votes.restart_wait_ms, Some(400));
    }

    #[test]
    fn nothing_to_give_back_only_when_every_master_refused() {
        let mut votes = Votes::new(3);
        for _ in 0..3 {
            votes.count(Vote::Held { ttl_ms: 5 });
        }
        assert!(votes.nothing_granted());
        let mut votes = Votes::new(3);
        votes.count(Vote::Held { ttl_ms: 5 });
        votes.count(Vote::Held { ttl_ms: 5 });
        assert!(!votes.nothing_granted(), "one master has not answered yet");
        votes.count(Vote::Refused);
        assert!(votes.nothing_granted(), "a refused connection sent nothing");
        let mut votes = Votes::new(3);
        votes.count(Vote::Held { ttl_ms: 5 });
        votes.count(Vote::Held { ttl_ms: 5 });
        votes.count(Vote::NoAnswer);
        assert!(!votes.nothing_granted(), "a silent master may have granted");
    }

    /// The tally of `masters` masters' replies, `so_far` counted.
    fn counted(masters: usize, so_far: &[Reply]) -> Replies {
        let mut replies = Replies::new(masters);
        for reply in so_far {
            replies.count(*reply);
        }
        replies
    }

    #[test]
    fn a_renewal_counts_a_majority_either_way() {
        let mut replies = counted(5, &[Reply::Ours, Reply::NotOurs, Reply::NoAnswer]);
        assert!(!replies.ours_on_a_majority() && !replies.lost_on_a_majority());
        replies.count(Reply::NotOurs);
        replies.count(Reply::NotOurs);
        assert!(replies.lost_on_a_majority());
    }

    #[test]
    fn a_master_that_is_down_is_no_reason_to_retry() {
        let replies = counted(3, &[Reply::Ours, Reply::Down, Reply::NotOurs]);
        assert_eq!(replies.no_answer, 0);
        assert!(!replies.ours_on_a_majority() && !replies.lost_on_a_majority());
    }
}
