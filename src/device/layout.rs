//! The layout of what the ranks of a CUDA IPC communicator share, in one place: the words of
//! a flag page (barrier flags, the done/ticket/abort/fault words, the direct flow's resolved
//! word and card ring), the cards of that ring, a region's board, and the sizes they follow
//! from. Constants only: the modules that use the pages, regions and boards (`ipc.rs`,
//! `region.rs`, `watch.rs`, `window.rs`, `direct.rs`) name this one and not each other for it.

/// Ranks the flag pages have room for ([`crate::algo::select::IPC_MAX_RANKS`], which the mode's
/// choice reads).
pub(crate) const MAX_RANKS: usize = crate::algo::select::IPC_MAX_RANKS;
/// Flag words: barrier phases 0 and 1, the closing barrier, the send/receive barrier phases
/// 0 and 1 and the captured calls' barrier phases 0 and 1 (one word per sender each), the "done" word
/// (the last chunk sequence number this rank's stream finished), the ticket word (the number of the last call this rank's stream
/// finished, collective or send/receive) and the abort word (1 + the rank that failed first,
/// written by that rank's watchdog into every peer's page), and the fault word (set by a fold
/// kernel whose boards disagree: `window.rs`). "Done" and ticket are adjacent and 8-byte
/// aligned: a call ends with one 64-bit stream write of both. Then the resolved word (the last
/// round of a direct all-reduce between processes whose peers' buffers this rank's opener
/// thread has mapped: `direct.rs`) and the ring of this rank's published direct calls
/// ([`RING`] cards, read by the peers' openers).
pub(crate) const WORDS: usize = CARDS + RING * CARD_WORDS;
/// The "done" word (see [`WORDS`]).
pub(crate) const DONE: usize = 7 * MAX_RANKS;
/// The ticket word (see [`WORDS`]).
pub(crate) const TICKET: usize = 7 * MAX_RANKS + 1;
/// The abort word (see [`WORDS`]).
pub(crate) const ABORT: usize = 7 * MAX_RANKS + 2;
/// The fault word (see [`WORDS`]).
pub(crate) const FAULT: usize = 7 * MAX_RANKS + 3;
/// The resolved word (see [`WORDS`]).
pub(crate) const RESOLVED: usize = 7 * MAX_RANKS + 4;
/// The last direct all-reduce round that was not its call's last, once this rank's stream
/// finished it (`direct.rs`: the ring's reuse within a call of many rounds).
pub(crate) const ROUND_DONE: usize = 7 * MAX_RANKS + 5;
/// First word of the card ring (8-byte aligned: cards hold 64-bit words).
pub(crate) const CARDS: usize = 7 * MAX_RANKS + 6;
/// Largest all-reduce (bytes) that takes the one-shot small-message flow, and the size of each
/// of the two small slots of a region ([`crate::algo::select::IPC_SMALL_BYTES`]).
pub(crate) const SMALL: usize = crate::algo::select::IPC_SMALL_BYTES;
/// The closing barrier's phase.
pub(crate) const CLOSING: usize = 2;
/// First of the two send/receive barrier phases (`p2p.rs`): their flags count per pair of ranks.
pub(crate) const P2P: usize = 3;
/// First of the two barrier phases of calls captured into CUDA graphs: a flag is set to 1 by
/// its writer and back to 0 by its owner once it passed (values a replay can repeat).
pub(crate) const CAPTURE: usize = 5;

/// Word of flag (`phase`, `from`) in a flag page.
pub(crate) fn flag(phase: usize, from: usize) -> usize {
    phase * MAX_RANKS + from
}

/// Bytes of a flag page of [`WORDS`] words.
pub(crate) fn page_len() -> usize {
    super::flags::page_len(WORDS)
}

/// Rounds of direct all-reduces a rank may have in flight (cards in its ring).
pub(crate) const RING: usize = 64;
/// 32-bit words of a card: stamp (`d`), tag, count, then two buffers of [`BUF_WORDS`].
pub(crate) const CARD_WORDS: usize = 6 + 2 * BUF_WORDS;
/// A buffer in a card: kind (1: IPC handle, 2: the owner's area), address, base, handle.
pub(crate) const BUF_WORDS: usize = 6 + 16;
/// Word of a card's stamp (`d`); then its tag, count, send and receive buffers.
pub(crate) const C_STAMP: usize = 0;
/// See [`C_STAMP`].
pub(crate) const C_TAG: usize = 2;
/// See [`C_STAMP`].
pub(crate) const C_COUNT: usize = 4;
/// See [`C_STAMP`].
pub(crate) const C_SEND: usize = 6;
/// See [`C_STAMP`].
pub(crate) const C_RECV: usize = 6 + BUF_WORDS;

/// Bytes of a region's board (four 64-bit words, `window.rs`), padded to keep the allocation's
/// size a multiple of 256.
pub(crate) const BOARD: usize = 256;

/// Words of a board, in the order `cuda/reduce.cu` reads them: tag, count, `send`, `recv`.
pub(crate) const BOARD_TAG: u64 = 0;
/// See [`BOARD_TAG`].
pub(crate) const BOARD_COUNT: u64 = 1;
/// See [`BOARD_TAG`].
pub(crate) const BOARD_SEND: u64 = 2;
/// See [`BOARD_TAG`].
pub(crate) const BOARD_RECV: u64 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_do_not_overlap() {
        // The flag words of the phases, the closing barrier and the done word never overlap.
        assert_eq!(flag(1, 0), flag(0, MAX_RANKS - 1) + 1);
        assert_eq!(flag(CLOSING, MAX_RANKS - 1) + 1, flag(P2P, 0));
        assert_eq!(flag(P2P + 1, MAX_RANKS - 1) + 1, flag(CAPTURE, 0));
        assert_eq!(flag(CAPTURE + 1, MAX_RANKS - 1) + 1, DONE);
        assert_eq!((DONE + 1, TICKET + 1), (TICKET, ABORT));
        assert_eq!(DONE * 4 % 8, 0, "one 64-bit write covers done and ticket");
        assert!(TICKET < WORDS && WORDS * 4 <= page_len());
    }

    #[test]
    fn cards_fit_their_words_and_the_page() {
        assert_eq!(C_RECV + BUF_WORDS, CARD_WORDS);
        assert_eq!(CARDS % 2, 0, "cards hold 64-bit words");
        assert!(CARDS + RING * CARD_WORDS == WORDS && WORDS * 4 <= page_len());
    }
}
