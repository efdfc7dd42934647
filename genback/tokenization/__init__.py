"""Tokens and exact byte vocabularies of Hugging Face tokenizers."""

from .token import Token
from .vocab import PAD_TEMPLATE, ByteVocabError, bytes_to_unicode, decode_vocab, get_byte_vocab

__all__ = ["Token", "decode_vocab", "get_byte_vocab", "bytes_to_unicode", "PAD_TEMPLATE", "ByteVocabError"]
