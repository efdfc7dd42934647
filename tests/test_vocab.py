"""Exact byte vocabularies of real tokenizers (offline): GPT-2, SmolLM2 (byte-level BPE) and
Gemma-3 (SentencePiece-style with byte fallback and duplicate byte strings)."""

import collections

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import _vocab_fixtures as F
from genback.tokenization import PAD_TEMPLATE, Token, bytes_to_unicode, decode_vocab, get_byte_vocab

NAMES = ["gpt2", "smollm2", "gemma3"]


def _load(name):
    tok = F.LOADERS[name]()
    if tok is None:
        pytest.skip(F.MISSING[name])
    return name, tok, F.byte_vocab(name)


@pytest.fixture(scope="module", params=NAMES)
def tok_and_vocab(request):
    return _load(request.param)


@pytest.fixture(scope="module")
def gpt2():
    return _load("gpt2")


@pytest.fixture(scope="module")
def smollm2():
    return _load("smollm2")


@pytest.fixture(scope="module")
def gemma3():
    return _load("gemma3")


def test_byte_to_unicode_table_is_a_bijection_of_printables():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"  # GPT-2's "Ġ"
    assert all(c.isprintable() and not c.isspace() for c in table.values())


def test_sizes_and_types(tok_and_vocab):
    name, tok, vocab = tok_and_vocab
    expected = {"gpt2": 50257, "smollm2": 49152, "gemma3": 262144}[name]
    assert len(vocab) == expected
    assert all(type(t) is Token and t.token_id == i for i, t in enumerate(vocab))


KNOWN = {
    "gpt2": {"Hello": b"Hello", " world": b" world", "<|endoftext|>": b"<|endoftext|>"},
    "smollm2": {" Paris": b" Paris", "<|im_end|>": b"<|im_end|>", "\n": b"\n"},
    "gemma3": {"<eos>": b"<eos>", " world": b" world", "<0xE2>": b"\xe2"},
}


def test_known_tokens(tok_and_vocab):
    name, tok, vocab = tok_and_vocab
    for text, want in KNOWN[name].items():
        if name == "gemma3" and text.startswith("<0x"):
            tid = tok.convert_tokens_to_ids(text)
        elif text in tok.get_vocab() or text.startswith("<"):
            tid = tok.convert_tokens_to_ids(text)
        else:
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) == 1, (text, ids)
            tid = ids[0]
        assert vocab[tid].byte_string == want


def test_gpt2_hello_world_ids(gpt2):
    name, tok, vocab = gpt2
    assert tok.encode("Hello world") == [15496, 995]
    assert vocab[15496] == b"Hello" and vocab[995] == b" world"


def test_gemma_duplicates_stay_distinct(gemma3):
    name, tok, vocab = gemma3
    counts = collections.Counter(t.byte_string for t in vocab)
    dups = {b: c for b, c in counts.items() if c > 1}
    assert len(dups) == 110 and all(c == 2 for c in dups.values())
    # e.g. the byte-fallback token <0x01> and the literal "\x01" token
    ids = [t.token_id for t in vocab if t.byte_string == b"\x01"]
    assert len(ids) == 2 and vocab[ids[0]] != vocab[ids[1]]
    assert {tok.convert_ids_to_tokens(i) for i in ids} == {"<0x01>", "\x01"}


ALPHABET = st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),  # anything encodable
    st.sampled_from(list("😀🎉日本語中文한국어 \n\t\r\x00\x01\x7f\u200b\ufeffé∑Ġ")),
)
# pieces that look like token syntax: byte-fallback names, special-token brackets
PIECES = st.sampled_from(["<0x41>", "<0xE2>", "<|", "|>", "<unk", "\u2581x"])


def _roundtrip(tok, vocab, text):
    ids = tok.encode(text, add_special_tokens=False)
    return b"".join(vocab[i] for i in ids)


@pytest.mark.parametrize("text", ["Hello world", " 😀 日本語\x01\x7f\n\t  x", "naïve — “q”", "<0x41> <eos>?", "\u200b𝔘𝔫"])
def test_roundtrip_examples(tok_and_vocab, text):
    name, tok, vocab = tok_and_vocab
    if name == "gemma3" and "<eos>" in text:
        text = text.replace("<eos>", "eos")  # special-token text is parsed as the special token
    assert _roundtrip(tok, vocab, text) == text.encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.text(ALPHABET, max_size=12), PIECES), max_size=6))
def test_roundtrip_property(tok_and_vocab, parts):
    name, tok, vocab = tok_and_vocab
    text = " ".join(parts)
    if name == "gemma3":
        # Gemma's normalizer turns " " into "▁" and its decoder turns "▁" back into " ":
        # a literal U+2581 in the input cannot survive, in the tokenizer itself.
        text = text.replace("\u2581", "_")
    for special in tok.all_special_tokens:
        text = text.replace(special, "")
    ids = tok.encode(text, add_special_tokens=False)
    # SmolLM2 has no single-byte tokens for bytes that never occur in UTF-8 training text
    # (e.g. 0xF1: U+40000): its tokenizer drops them, so such text is not representable at all.
    assume(tok.decode(ids, clean_up_tokenization_spaces=False) == text)
    assert b"".join(vocab[i] for i in ids) == text.encode()


def test_smollm2_missing_bytes_are_dropped_by_the_tokenizer_itself(smollm2):
    name, tok, vocab = smollm2
    singles = {t.byte_string for t in vocab if len(t.byte_string) == 1}
    assert 0xF1 not in {b[0] for b in singles}
    ids = tok.encode("\U00040000", add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids) == b"\x80\x80\x80"  # the 0xF1 byte is lost
    assert tok.decode(ids) != "\U00040000"


def test_padding_and_truncation(gpt2):
    name, tok, vocab = gpt2
    padded, strs = decode_vocab(tok, vocab_size=50260)
    assert len(padded) == len(strs) == 50260
    assert [t.byte_string for t in padded[-3:]] == [PAD_TEMPLATE % i for i in (50257, 50258, 50259)]
    assert padded[-1].byte_string == b"<|genback_pad_50259|>" and strs[-1] == "<|genback_pad_50259|>"
    assert padded[:50257] == vocab  # ids unchanged
    with pytest.raises(ValueError, match="smaller than the tokenizer's vocabulary"):
        get_byte_vocab(tok, vocab_size=50000)
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        get_byte_vocab(tok, vocab_size="50260")


def test_str_vocab_fallbacks(gpt2):
    name, tok, vocab = gpt2
    bad = next(t for t in vocab if not _utf8(t.byte_string))
    tid = bad.token_id
    assert decode_vocab(tok, "tokenizer")[1][tid] == tok.convert_ids_to_tokens(tid)
    assert decode_vocab(tok, "latin1")[1][tid] == bad.byte_string.decode("latin-1")
    assert decode_vocab(tok, "replace")[1][tid] == bad.byte_string.decode("utf-8", "replace")
    assert decode_vocab(tok)[1][15496] == "Hello"
    with pytest.raises(ValueError, match="byte2str_fallback"):
        decode_vocab(tok, "ignore")


def _utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---------------------------------------------------------------- unsupported tokenizers
def _wordpiece():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordPiece({"[UNK]": 0, "he": 1, "##llo": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=t)


def test_wordpiece_is_refused():
    with pytest.raises(ValueError, match="neither ByteLevel nor SentencePiece"):
        decode_vocab(_wordpiece())


def test_byte_level_with_foreign_character_is_refused():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE({"a": 0, "b": 1, "a\u2603": 2}, []))  # snowman is not in the table
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    with pytest.raises(ValueError, match="outside the byte-level BPE byte-to-unicode table"):
        get_byte_vocab(PreTrainedTokenizerFast(tokenizer_object=t))


def test_object_without_vocabulary_is_refused():
    class Weird:
        def get_vocab(self):
            return {"a": 0}

        added_tokens_decoder = {}

    with pytest.raises(ValueError, match="cannot be recovered"):
        get_byte_vocab(Weird())


def test_decode_vocab_error_says_it_could_not_decode():
    from genback.tokenization import ByteVocabError

    with pytest.raises(ByteVocabError, match="Could not decode byte representation"):
        decode_vocab(_wordpiece())


def test_check_byte_decoder(gpt2):
    from genback.tokenization.vocab import ByteDecoderError, check_byte_decoder

    _, tok, _ = gpt2
    table = {c: b for b, c in bytes_to_unicode().items()}
    assert check_byte_decoder(tok, table) is None  # GPT-2's own table decodes its vocabulary
    with pytest.raises(ByteDecoderError, match="not a byte"):
        check_byte_decoder(tok, {**table, "a": 999})
    with pytest.raises(ByteDecoderError, match="missing from byte_decoder"):
        check_byte_decoder(tok, {})
    with pytest.raises(ByteDecoderError, match="disagree"):  # two characters swapped
        check_byte_decoder(tok, {**table, "a": table["b"], "b": table["a"]})
    with pytest.raises(TypeError, match="byte_decoder"):
        check_byte_decoder(tok, [("a", 97)])
