"""``Token``: one vocabulary entry, its id together with its exact bytes.

Two vocabulary entries can have the same bytes (Gemma-3 has about a hundred such pairs, e.g. a
special token whose text equals an ordinary token's text). A plain ``bytes`` object cannot keep
them apart, so the vocabulary is a list of ``Token`` objects instead.

``Token`` subclasses ``bytes`` so that code written for a ``list[bytes]`` vocabulary keeps working
unchanged: ``b"".join(tokens)``, ``len(tok)``, ``tok[0]``, iteration (yielding ints),
``tok.decode()``, ``tok.startswith(b" ")`` all behave as on the token's bytes.

Equality and hashing:

* ``Token == Token`` compares ``token_id`` only (two ids with equal bytes are different tokens;
  the same id always carries the same bytes within one vocabulary). ``hash(tok) ==
  hash(tok.token_id)``.
* ``Token == bytes`` compares the bytes, as ``bytes.__eq__`` would, for compatibility with
  clients that write ``tok == b"\\n"``. Because the hash is the id's, do not mix ``Token`` and
  plain ``bytes`` keys in one dict or set.
* Ordering (``<`` etc.) between tokens is by ``token_id``.
"""

from __future__ import annotations

__all__ = ["Token"]


class Token(bytes):
    """A vocabulary token: ``token_id`` (int) plus ``byte_string`` (bytes).

    Args:
        token_id: the token's id (its index in the model's logit row), a non-negative ``int``.
        byte_string: the exact bytes the token stands for, ``bytes`` (not ``str``).

    Raises:
        TypeError: ``token_id`` is not an ``int`` (``bool`` is rejected) or ``byte_string`` is
            not ``bytes``/``bytearray``/``memoryview``.
        ValueError: ``token_id`` is negative.
    """

    # ``bytes`` is a variable-size type: it cannot take non-empty ``__slots__``; one instance
    # attribute is stored in the instance dict.

    def __new__(cls, token_id: int, byte_string: bytes) -> "Token":
        if type(token_id) is not int:
            if isinstance(token_id, bool) or type(token_id).__name__ == "bool_":
                raise TypeError(f"Token: token_id must be an int, got bool {token_id!r}")
            # numpy / torch integer scalars are accepted through ``__index__``.
            try:
                token_id = token_id.__index__()  # type: ignore[union-attr]
            except (AttributeError, TypeError):
                raise TypeError(
                    f"Token: token_id must be an int, got {type(token_id).__name__} {token_id!r}"
                ) from None
        if token_id < 0:
            raise ValueError(f"Token: token_id must be >= 0, got {token_id}")
        if not isinstance(byte_string, (bytes, bytearray, memoryview)):
            raise TypeError(
                "Token: byte_string must be bytes, got "
                f"{type(byte_string).__name__} {byte_string!r}"
            )
        self = super().__new__(cls, byte_string)
        self.token_id = int(token_id)
        return self

    @property
    def byte_string(self) -> bytes:
        """The token's bytes as a plain ``bytes`` object (not a ``Token``)."""
        return bytes(self)

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={bytes(self)!r})"

    __str__ = __repr__

    def __eq__(self, other):
        if isinstance(other, Token):
            return self.token_id == other.token_id
        return bytes.__eq__(self, other)

    def __ne__(self, other):
        if isinstance(other, Token):
            return self.token_id != other.token_id
        return bytes.__ne__(self, other)

    def __hash__(self) -> int:
        return hash(self.token_id)

    def __lt__(self, other):
        if isinstance(other, Token):
            return self.token_id < other.token_id
        return NotImplemented

    def __le__(self, other):
        if isinstance(other, Token):
            return self.token_id <= other.token_id
        return NotImplemented

    def __gt__(self, other):
        if isinstance(other, Token):
            return self.token_id > other.token_id
        return NotImplemented

    def __ge__(self, other):
        if isinstance(other, Token):
            return self.token_id >= other.token_id
        return NotImplemented

    def __reduce__(self):
        # pickle / copy: rebuild through __new__ (the default would lose token_id).
        return (Token, (self.token_id, bytes(self)))

    @staticmethod
    def is_plain_bytes(item) -> bool:
        """True when ``item`` is a ``bytes`` object that is not a ``Token``."""
        return isinstance(item, bytes) and not isinstance(item, Token)

    @staticmethod
    def as_bytes(item) -> bytes:
        """The plain bytes of a ``Token``, or ``item`` itself when it is ``bytes``.

        Raises:
            TypeError: ``item`` is neither a ``Token`` nor ``bytes``.
        """
        if isinstance(item, Token):
            return bytes(item)
        if isinstance(item, bytes):
            return item
        raise TypeError(f"Token.as_bytes: expected Token or bytes, got {type(item).__name__} {item!r}")
