"""Incremental detokenization equals decoding everything at once, and never emits a broken
character that a later token completes."""
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.engine.text.detokenizer import IncrementalDetokenizer

MIXED = "Hi 🙂👨‍👩‍👧 — 你好世界 日本語 ünïcödé 🇫🇷 ok\n\tend 𝄞"


def stream(tokenizer, ids, chunks=None, skip_special_tokens=True):
    """Push `ids` one at a time (or in the given chunk sizes); return the deltas."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas, pos = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detokenizer.push(ids[pos:pos + size]))
        pos += size
    deltas.append(detokenizer.push(ids[pos:]))
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    return deltas


def test_multibyte_characters_split_across_tokens(default_tokenizer):
    ids = default_tokenizer.encode(MIXED, add_special_tokens=False)
    singles = [default_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in text for text in singles)   # some characters span tokens
    deltas = stream(default_tokenizer, ids)
    assert "".join(deltas) == MIXED
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas[:-2]   # something was held back until its character completed


def test_emoji_held_until_complete(default_tokenizer):
    ids = default_tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(default_tokenizer)
    assert [detokenizer.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert detokenizer.flush() == ""


def test_flush_emits_an_unfinished_character(default_tokenizer):
    ids = default_tokenizer.encode("ab🙂", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(default_tokenizer)
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
    assert text == default_tokenizer.decode(ids) and text.endswith("\ufffd")


def test_skip_special_tokens(default_tokenizer):
    ids = [1, *default_tokenizer.encode("hi 🙂", add_special_tokens=False), 2, 0]
    assert "".join(stream(default_tokenizer, ids)) == "hi 🙂"
    assert "".join(stream(default_tokenizer, ids, skip_special_tokens=False)) == \
        "<|im_start|>hi 🙂<|im_end|><|endoftext|>"


def test_cost_per_token_does_not_grow(default_tokenizer):
    """Each push decodes a small window, not the whole output."""
    class Recording:
        def __init__(self, backend):
            self.backend, self.longest = backend, 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    class Tokenizer:
        backend_tokenizer = Recording(default_tokenizer.backend_tokenizer)

    ids = default_tokenizer.encode(MIXED * 50, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(Tokenizer())
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
    assert text == MIXED * 50
    assert len(ids) > 1000 and Tokenizer.backend_tokenizer.longest <= 8


@st.composite
def token_streams(draw, tokenizer_ids):
    vocab_size, partial_ids = tokenizer_ids
    pick = st.one_of(st.integers(0, vocab_size - 1), st.sampled_from(partial_ids))
    ids = draw(st.lists(pick, max_size=40))
    chunks = draw(st.lists(st.integers(1, 5), max_size=len(ids)))
    return ids, chunks


def test_random_streams_equal_full_decode(default_tokenizer):
    # tokens that are pieces of multi-byte characters make the interesting streams
    partial_ids = sorted(set(default_tokenizer.encode(MIXED * 2 + "ĀĂĄ ḀḂ ₠₡ 𐍈𐍉",
                                                      add_special_tokens=False)))
    vocab = (len(default_tokenizer), partial_ids)

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(token_streams(vocab), st.booleans())
    def check(stream_and_chunks, skip):
        ids, chunks = stream_and_chunks
        deltas = stream(default_tokenizer, ids, chunks, skip_special_tokens=skip)
        assert "".join(deltas) == default_tokenizer.decode(ids, skip_special_tokens=skip)

    check()
