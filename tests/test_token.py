import copy
import pickle

import numpy as np
import pytest

from genback.tokenization import Token


def test_attributes_and_bytes_behaviour():
    t = Token(token_id=7, byte_string=b"ab")
    assert t.token_id == 7 and t.byte_string == b"ab" and type(t.byte_string) is bytes
    assert list(t) == [97, 98] and len(t) == 2 and t[0] == 97
    assert b"".join([t, Token(8, b"c")]) == b"abc"
    assert t.decode() == "ab" and t.startswith(b"a")
    assert repr(t) == "Token(token_id=7, byte_string=b'ab')"


def test_equality_and_hash_by_id():
    a, b = Token(1, b"x"), Token(2, b"x")
    assert a != b and len({a, b}) == 2
    assert a == Token(1, b"x") and hash(a) == hash(1)
    assert a == b"x" and a != b"y"  # comparison with plain bytes is by content
    assert sorted([Token(3, b"a"), Token(1, b"z")])[0].token_id == 1


def test_helpers():
    t = Token(0, b"q")
    assert Token.is_plain_bytes(b"q") and not Token.is_plain_bytes(t) and not Token.is_plain_bytes("q")
    assert Token.as_bytes(t) == b"q" and type(Token.as_bytes(t)) is bytes
    assert Token.as_bytes(b"r") == b"r"
    with pytest.raises(TypeError, match="expected Token or bytes"):
        Token.as_bytes("r")


def test_pickle_and_copy_keep_id():
    t = Token(5, b"\xff")
    for u in (pickle.loads(pickle.dumps(t)), copy.copy(t), copy.deepcopy(t)):
        assert isinstance(u, Token) and u.token_id == 5 and u.byte_string == b"\xff"


def test_numpy_integer_id_accepted():
    assert Token(np.int64(3), b"a").token_id == 3


@pytest.mark.parametrize(
    "tid, bs, exc, msg",
    [
        (True, b"a", TypeError, "bool"),
        (1.0, b"a", TypeError, "float"),
        ("1", b"a", TypeError, "str"),
        (-1, b"a", ValueError, ">= 0"),
        (1, "a", TypeError, "byte_string must be bytes"),
    ],
)
def test_bad_arguments(tid, bs, exc, msg):
    with pytest.raises(exc, match=msg):
        Token(tid, bs)
