//! Reading what a request body holds already, without waiting: the replay layer reads
//! a buffered body (or a whole `Full`) at once for the fingerprint and the record, and
//! only awaits a body that is not over.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http_body::Body;

use crate::buffer::BodyReadError;

/// What of a body [`read_now`] could read without waiting.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ReadNow {
    /// The whole body.
    Whole(Bytes),
    /// What came so far (maybe nothing): the body is not over, the rest is awaited.
    Partly(Bytes),
    /// What [`read_body`] would have said.
    Failed(BodyReadError),
}

/// Reads what `body` holds already, at most `limit` bytes (and nothing if the declared
/// `content_length` is over it): a body an outer layer buffered, or a whole `Full`,
/// is read with no future, no timer, and no copy when it comes in one chunk. It is
/// polled with a no-op waker; a body that is not over is polled again by its reader,
/// whose waker it then keeps.
pub(crate) fn read_now<B>(
    mut body: Pin<&mut B>,
    content_length: Option<u64>,
    limit: usize,
) -> ReadNow
where
    B: Body<Data = Bytes> + ?Sized,
{
    if content_length.is_some_and(|len| len > limit as u64) {
        return ReadNow::Failed(BodyReadError::TooLarge);
    }
    let mut cx = Context::from_waker(Waker::noop());
    let mut read = Chunks::default();
    loop {
        if body.is_end_stream() {
            return ReadNow::Whole(read.into_bytes());
        }
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Pending => return ReadNow::Partly(read.into_bytes()),
            Poll::Ready(None) => return ReadNow::Whole(read.into_bytes()),
            Poll::Ready(Some(Err(_))) => return ReadNow::Failed(BodyReadError::Broken),
            Poll::Ready(Some(Ok(frame))) => {
                // Trailers carry no body bytes.
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if read.len() + data.len() > limit {
                    return ReadNow::Failed(BodyReadError::TooLarge);
                }
                read.push(data);
            }
        }
    }
}

/// Chunks read so far: the first kept as it is, copied only when a second comes.
#[derive(Default)]
struct Chunks {
    first: Bytes,
    joined: Option<BytesMut>,
}

impl Chunks {
    fn len(&self) -> usize {
        self.joined.as_ref().map_or(self.first.len(), BytesMut::len)
    }

    fn push(&mut self, data: Bytes) {
        match &mut self.joined {
            Some(joined) => joined.extend_from_slice(&data),
            None if self.first.is_empty() => self.first = data,
            None => {
                let mut joined = BytesMut::with_capacity(self.first.len() + data.len());
                joined.extend_from_slice(&self.first);
                joined.extend_from_slice(&data);
                self.joined = Some(joined);
            }
        }
    }

    fn into_bytes(self) -> Bytes {
        self.joined.map_or(self.first, BytesMut::freeze)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::Full;

    use super::*;
    use crate::buffer::read_body;

    type Poll1 = Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>>;

    /// A body that answers each poll from its script, then ends; `Pending` where it
    /// would wait, after which it wakes its reader at once.
    struct Scripted(std::collections::VecDeque<Poll1>);

    impl Body for Scripted {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll1 {
            let next = self.get_mut().0.pop_front().unwrap_or(Poll::Ready(None));
            if next.is_pending() {
                cx.waker().wake_by_ref();
            }
            next
        }
    }

    fn data(bytes: &[u8]) -> Poll1 {
        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::copy_from_slice(
            bytes,
        )))))
    }

    fn scripted(polls: impl IntoIterator<Item = Poll1>) -> Scripted {
        Scripted(polls.into_iter().collect())
    }

    fn now<B: Body<Data = Bytes> + Unpin>(mut body: B, limit: usize) -> ReadNow {
        read_now(Pin::new(&mut body), None, limit)
    }

    #[test]
    fn a_whole_body_is_read_at_once_and_one_chunk_is_not_copied() {
        let hello = Bytes::from_static(b"hello");
        match now(Full::new(hello.clone()), 5) {
            ReadNow::Whole(read) => assert_eq!(read.as_ptr(), hello.as_ptr()),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            now(Full::new(Bytes::new()), 5),
            ReadNow::Whole(Bytes::new())
        );
        let trailers = Poll::Ready(Some(Ok(http_body::Frame::trailers(http::HeaderMap::new()))));
        let chunks = scripted([data(b"he"), data(b"llo"), trailers]);
        assert_eq!(now(chunks, 5), ReadNow::Whole(hello));
    }

    #[test]
    fn a_body_not_over_gives_what_came_so_far() {
        let partly = now(scripted([data(b"he"), Poll::Pending, data(b"llo")]), 5);
        assert_eq!(partly, ReadNow::Partly(Bytes::from_static(b"he")));
        assert_eq!(
            now(scripted([Poll::Pending]), 5),
            ReadNow::Partly(Bytes::new())
        );
    }

    #[test]
    fn limits_and_broken_bodies_fail_as_read_body_does() {
        let hello = || Full::new(Bytes::from_static(b"hello"));
        let mut declared = hello();
        let declared = read_now(Pin::new(&mut declared), Some(6), 5);
        assert_eq!(declared, ReadNow::Failed(BodyReadError::TooLarge));
        assert_eq!(now(hello(), 4), ReadNow::Failed(BodyReadError::TooLarge));
        let over = scripted([data(b"hel"), data(b"lo!")]);
        assert_eq!(now(over, 5), ReadNow::Failed(BodyReadError::TooLarge));
        let broken = scripted([
            data(b"he"),
            Poll::Ready(Some(Err(std::io::ErrorKind::BrokenPipe.into()))),
        ]);
        assert_eq!(now(broken, 5), ReadNow::Failed(BodyReadError::Broken));
    }

    proptest::proptest! {
        /// What `read_now` reads, then `read_body` for the rest within what is left of
        /// the limit, is what `read_body` reads alone: the same bytes or the same error.
        #[test]
        fn reading_now_then_the_rest_is_reading_it_all(
            script in proptest::collection::vec(
                proptest::option::of(proptest::collection::vec(proptest::num::u8::ANY, 0..4)),
                0..8,
            ),
            limit in 0usize..12,
        ) {
            // `None`: the body waits there.
            let body = || {
                scripted(script.iter().map(|step| match step {
                    Some(bytes) => data(bytes),
                    None => Poll::Pending,
                }))
            };
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            let timeout = Duration::from_secs(1);
            let alone = runtime.block_on(read_body(None, body(), limit, timeout));
            let mut split = body();
            let in_two = match read_now(Pin::new(&mut split), None, limit) {
                ReadNow::Whole(bytes) => Ok(bytes),
                ReadNow::Failed(error) => Err(error),
                ReadNow::Partly(first) => runtime
                    .block_on(read_body(None, split, limit - first.len(), timeout))
                    .map(|rest| [first, rest].concat().into()),
            };
            proptest::prop_assert_eq!(in_two, alone);
        }
    }
}
